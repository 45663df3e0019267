"""A run's model cut into pipeline stages, as the run config's ``stage_layers`` says.

The head owns the token embedding and its blocks; bodies own blocks; the tail owns its blocks,
the final norm, the LM head and the loss. Stages exchange boundary payloads (B, T, k), never
the (B, T, d) residual stream (see ``subspace``). Every stage exposes the same ``forward``:

    head:  forward(tokens)                    -> boundary (B, T, k)
    body:  forward(tokens, boundary)          -> boundary (B, T, k)
    tail:  forward(tokens, boundary, labels)  -> per-sample loss (B,)

so workers treat all stages alike. ``ComposedModel`` runs the same stages as one module
without the codec: the centralized reference.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from agora_core.config.run import ModelConfig, RunConfig
from agora_worker.model.blocks import INIT_STD, Block, RMSNorm
from agora_worker.model.seeding import normal
from agora_worker.model.subspace import EMBEDDING_STD, FixedParts

StageKind = Literal["head", "body", "tail"]


def stage_kind(stage: int, n_stages: int) -> StageKind:
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} does not exist: the run has stages 0..{n_stages - 1}")
    return "head" if stage == 0 else "tail" if stage == n_stages - 1 else "body"


def stage_layer_range(config: ModelConfig, stage: int) -> range:
    """Indices, in the whole model, of the blocks ``stage`` owns."""
    start = sum(config.stage_layers[:stage])
    return range(start, start + config.stage_layers[stage])


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample. (B, T, V), (B, T) -> (B,)"""
    b, t, v = logits.shape
    losses = F.cross_entropy(logits.reshape(b * t, v).float(), labels.reshape(b * t), reduction="none")
    return losses.view(b, t).mean(dim=1)


class TransformerStage(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, stage: int):
        super().__init__()
        self.config = config
        self.stage = stage
        self.kind = stage_kind(stage, config.n_stages)
        self.boundary_width = config.subspace_rank
        self.fixed = FixedParts(config, seed)
        if self.kind == "head":  # the trained part of the embedding, E: (V, k)
            self.embedding = nn.Parameter(
                normal((config.vocab_size, config.subspace_rank), EMBEDDING_STD, seed, "embedding")
            )
        self.blocks = nn.ModuleList(Block(config, seed, layer) for layer in stage_layer_range(config, stage))
        if self.kind == "tail":
            self.norm = RMSNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(
                    normal((config.vocab_size, config.d_model), INIT_STD, seed, "lm_head")
                )

    # pieces, shared with ComposedModel ------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Head only: X0 = PE + T[tokens] + E[tokens] U^T. (B, T) -> (B, T, d)"""
        return self.fixed.fixed_stream(tokens) + self.embedding[tokens] @ self.fixed.basis.T

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.fixed.basis)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Tail only. (B, T, d) -> (B, T, V)"""
        return self.lm_head(self.norm(x))

    # the stage interface ---------------------------------------------------------------------

    def forward(
        self, tokens: torch.Tensor, boundary: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = self.embed(tokens) if self.kind == "head" else self.fixed.decode(boundary, tokens)
        x = self.run_blocks(x)
        if self.kind != "tail":
            return self.fixed.encode(x, tokens)  # (B, T, k)
        logits = self.logits(x)
        return logits if labels is None else per_sample_loss(logits, labels)

    def delay(self, phase: str, samples: int) -> None:
        """Surrogates inject compute time here; a real stage takes its own."""


class ComposedModel(nn.Module):
    """The stages as one module, without boundary codec: what a single GPU would train."""

    def __init__(self, stages: list[TransformerStage]):
        super().__init__()
        if [s.kind for s in stages][:1] != ["head"] or stages[-1].kind != "tail":
            raise ValueError("compose the stages of a whole model, head first, tail last")
        self.stages = nn.ModuleList(stages)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages[0].embed(tokens)
        for stage in self.stages:
            x = stage.run_blocks(x)
        return per_sample_loss(self.stages[-1].logits(x), labels)


def build_stage(run: RunConfig, stage: int, *, delay_scale: float = 1.0) -> nn.Module:
    """The module of ``stage`` with the run's initial weights (identical on every replica).
    ``delay_scale`` makes a surrogate stage that much slower (heterogeneous test swarms)."""
    if run.model.kind == "surrogate":
        from agora_worker.model.surrogate import SurrogateStage

        return SurrogateStage(run.model, run.seed, stage, delay_scale=delay_scale)
    return TransformerStage(run.model, run.seed, stage)
