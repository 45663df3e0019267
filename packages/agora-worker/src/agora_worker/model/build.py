"""A worker's stage module, chosen by the run config's ``model.kind``."""

from __future__ import annotations

from torch import nn

from agora_core.config.run import RunConfig
from agora_worker.model.stages import TransformerStage
from agora_worker.model.surrogate import SurrogateStage


def build_stage(run: RunConfig, stage: int, *, delay_scale: float = 1.0) -> nn.Module:
    """The module of ``stage`` with the run's initial weights (identical on every replica).
    ``delay_scale`` makes a surrogate stage that much slower (heterogeneous test swarms)."""
    if run.model.kind == "surrogate":
        return SurrogateStage(run.model, run.seed, stage, delay_scale=delay_scale)
    return TransformerStage(run.model, run.seed, stage)
