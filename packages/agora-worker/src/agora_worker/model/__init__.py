"""Stage models: the SSN transformer cut into stages, and surrogate stages for system tests."""

from agora_worker.model.build import build_stage
from agora_worker.model.stages import ComposedModel, TransformerStage
from agora_worker.model.surrogate import SurrogateStage

__all__ = ["ComposedModel", "SurrogateStage", "TransformerStage", "build_stage"]
