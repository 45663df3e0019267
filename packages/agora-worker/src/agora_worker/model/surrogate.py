"""Surrogate stages for system tests: small linear layers on the real boundary shapes.

They behave like stages to everything around them (same requests, same boundary payloads,
same optimizer and averaging paths) while computing almost nothing: injected per-sample
delays stand in for compute time, untrained dummy parameters for a large model's averaging
payload; fault injection: ``fail_token`` makes a batch holding it fail in compute, and
``nan_token`` makes it compute NaN (NaN outputs, losses and gradients).
"""

from __future__ import annotations

import torch
from torch import nn

from agora_core import world
from agora_core.config.run import ModelConfig
from agora_core.contract import StageRole
from agora_worker.model.loss import per_sample_loss
from agora_worker.model.seeding import normal


class SurrogateStage(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, stage: int, *, delay_scale: float = 1.0):
        super().__init__()
        self.delay_scale = delay_scale
        self.config = config
        self.stage = stage
        self.role = StageRole.of(stage, config.n_stages)
        self.boundary_width = k = config.subspace_rank
        self.surrogate = config.surrogate
        if self.role == StageRole.HEAD:
            self.embedding = nn.Parameter(normal((config.vocab_size, k), 0.1, seed, "surrogate.embedding"))
        self.linear = nn.Linear(k, k)
        with torch.no_grad():
            self.linear.weight.copy_(normal((k, k), 0.1, seed, f"surrogate.{stage}.linear"))
            self.linear.bias.zero_()
        if self.role == StageRole.TAIL:
            self.lm_head = nn.Linear(k, config.vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(normal((config.vocab_size, k), 0.1, seed, "surrogate.lm_head"))
        # Not trained, only averaged: each replica starts them at its own random values (unlike
        # every real weight), so averaging visibly brings them together.
        self.dummy = nn.Parameter(torch.randn(self.surrogate.dummy_parameters), requires_grad=False)

    def forward(
        self, tokens: torch.Tensor, boundary: torch.Tensor | None = None, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.surrogate.fail_token >= 0 and bool((tokens == self.surrogate.fail_token).any()):
            raise RuntimeError(f"injected failure: token {self.surrogate.fail_token} in the batch")
        x = self.embedding[tokens] if self.role == StageRole.HEAD else boundary  # (B, T, k)
        x = x + torch.tanh(self.linear(x))
        if self.surrogate.nan_token >= 0 and bool((tokens == self.surrogate.nan_token).any()):
            x = x * float("nan")  # every output, and every gradient through this stage, is NaN
        if self.role != StageRole.TAIL:
            return x
        logits = self.lm_head(x)  # (B, T, V)
        return logits if labels is None else per_sample_loss(logits, labels)

    def delay(self, direction: str, samples: int) -> None:
        """Sleep as long as ``samples`` would take to compute, ``direction`` forward or backward."""
        per_sample = (
            self.surrogate.forward_delay_s if direction == "forward" else self.surrogate.backward_delay_s
        )
        if per_sample > 0:  # stands in for compute: this is the compute thread (or a simulated one)
            world.hold(per_sample * self.delay_scale * samples)
