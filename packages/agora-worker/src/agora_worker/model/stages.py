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

import torch
from torch import nn

from agora_core.config.run import ModelConfig
from agora_core.contract import StageRole
from agora_worker.model.blocks import INIT_STD, Block, RMSNorm
from agora_worker.model.loss import per_sample_loss
from agora_worker.model.seeding import normal
from agora_worker.model.subspace import EMBEDDING_STD, FixedParts


def stage_layer_range(config: ModelConfig, stage: int) -> range:
    """Indices, in the whole model, of the blocks ``stage`` owns."""
    start = sum(config.stage_layers[:stage])
    return range(start, start + config.stage_layers[stage])


class TransformerStage(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, stage: int):
        super().__init__()
        self.config = config
        self.stage = stage
        self.role = StageRole.of(stage, config.n_stages)
        self.boundary_width = config.subspace_rank
        self.fixed = FixedParts(config, seed)
        if self.role == StageRole.HEAD:  # the trained part of the embedding, E: (V, k)
            self.embedding = nn.Parameter(
                normal((config.vocab_size, config.subspace_rank), EMBEDDING_STD, seed, "embedding")
            )
        self.blocks = nn.ModuleList(Block(config, seed, layer) for layer in stage_layer_range(config, stage))
        if self.role == StageRole.TAIL:
            self.norm = RMSNorm(config.d_model)
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(
                    normal((config.vocab_size, config.d_model), INIT_STD, seed, "lm_head")
                )

    # pieces, shared with ComposedModel ------------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Head only: X0 = PE + T[tokens] + E[tokens] U^T, in fp32. (B, T) -> (B, T, d)"""
        return self.fixed.fixed_stream(tokens) + self.fixed.expand(self.embedding[tokens])

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
        x = self.embed(tokens) if self.role == StageRole.HEAD else self.fixed.decode(boundary, tokens)
        x = self.run_blocks(x)
        if self.role != StageRole.TAIL:
            return self.fixed.encode(x, tokens)  # (B, T, k)
        logits = self.logits(x)
        return logits if labels is None else per_sample_loss(logits, labels)

    def delay(self, direction: str, samples: int) -> None:
        """Surrogates inject compute time here; a real stage takes its own."""


class ComposedModel(nn.Module):
    """The stages as one module, without boundary codec: what a single GPU would train."""

    def __init__(self, stages: list[TransformerStage]):
        super().__init__()
        if [s.role for s in stages][:1] != [StageRole.HEAD] or stages[-1].role != StageRole.TAIL:
            raise ValueError("compose the stages of a whole model, head first, tail last")
        self.stages = nn.ModuleList(stages)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.stages[0].embed(tokens)
        for stage in self.stages:
            x = stage.run_blocks(x)
        return per_sample_loss(self.stages[-1].logits(x), labels)
