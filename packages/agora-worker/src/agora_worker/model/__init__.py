"""Stage models: the SSN transformer cut into stages, and surrogate stages for system tests."""

from agora_worker.model.stages import ComposedModel, TransformerStage, build_stage, stage_kind
from agora_worker.model.surrogate import SurrogateStage

__all__ = ["ComposedModel", "SurrogateStage", "TransformerStage", "build_stage", "stage_kind"]
