"""The fixed parts of a reparameterized subspace network, and the stage boundary codec.

Every trainable contribution to the residual stream lies in span(U), U a fixed d x k basis
with orthonormal columns: attention and MLP outputs are (.) Z U^T, the trainable embedding is
E U^T. What is not in span(U) is fixed and known to every stage: the positional signal PE and
the fixed token table T[tokens]. So a stage boundary only needs

    C = (X - PE - T[tokens]) U          (B, T, k) instead of (B, T, d)

and the next stage rebuilds X = C U^T + PE + T[tokens] exactly. Gradients cross the same way:
the receiver differentiates with respect to C, k values per token.

Exactly means in fp32: the codec and the fixed parts run with autocast off, on fp32 inputs,
whatever dtype the blocks compute in (bf16 autocast on an accelerator), so a stage rebuilds
the residual stream to fp32 rounding. A run may still narrow the payload on the wire
(``transport.boundary_dtype = "bf16"``): then X is rebuilt to within bf16's rounding of C.
"""

from __future__ import annotations

import contextlib
import math

import torch

from agora_core.config.run import ModelConfig
from agora_worker.model.seeding import generator, normal

EMBEDDING_STD = 0.02


def full_precision(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Autocast off for ``tensor``'s device: what runs inside computes in its inputs' dtype."""
    return torch.autocast(device_type=tensor.device.type, enabled=False)


def subspace_basis(seed: int, d_model: int, rank: int) -> torch.Tensor:
    """U: (d, k) with orthonormal columns, the same for every stage of the run."""
    gaussian = torch.randn((d_model, rank), generator=generator(seed, "subspace_basis"), dtype=torch.float64)
    q, r = torch.linalg.qr(gaussian)
    q = q * torch.sign(torch.diagonal(r))  # a unique Q: QR's signs are otherwise arbitrary
    return q.float().contiguous()


def fixed_token_table(seed: int, vocab_size: int, d_model: int) -> torch.Tensor:
    """T: (V, d), the untrained part of the token embedding."""
    return normal((vocab_size, d_model), EMBEDDING_STD, seed, "fixed_token_table")


def positional_signal(seq_len: int, d_model: int) -> torch.Tensor:
    """PE: (L, d) sinusoids at the embedding's scale."""
    position = torch.arange(seq_len, dtype=torch.float64)[:, None]
    rate = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    signal = torch.zeros(seq_len, d_model, dtype=torch.float64)
    signal[:, 0::2] = torch.sin(position * rate)
    signal[:, 1::2] = torch.cos(position * rate[: d_model // 2])
    return (signal * EMBEDDING_STD).float()


class FixedParts(torch.nn.Module):
    """U, T and PE as non-persistent buffers: regenerated from the seed, never trained or sent."""

    def __init__(self, config: ModelConfig, seed: int):
        super().__init__()
        self.register_buffer(
            "basis", subspace_basis(seed, config.d_model, config.subspace_rank), persistent=False
        )
        self.register_buffer(
            "token_table", fixed_token_table(seed, config.vocab_size, config.d_model), persistent=False
        )
        self.register_buffer("positions", positional_signal(config.seq_len, config.d_model), persistent=False)

    def fixed_stream(self, tokens: torch.Tensor) -> torch.Tensor:
        """PE + T[tokens]: the part of the residual stream outside span(U). (B, T, d), fp32"""
        return self.positions[: tokens.shape[1]] + self.token_table[tokens]

    def encode(self, stream: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, d) residual stream -> (B, T, k) boundary payload, in fp32."""
        with full_precision(stream):
            return (stream.float() - self.fixed_stream(tokens)) @ self.basis

    def decode(self, boundary: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T, k) boundary payload -> (B, T, d) residual stream, in fp32."""
        with full_precision(boundary):
            return boundary.float() @ self.basis.T + self.fixed_stream(tokens)

    def expand(self, coefficients: torch.Tensor) -> torch.Tensor:
        """(.., k) coefficients -> (.., d) vectors of span(U), in fp32: C U^T."""
        with full_precision(coefficients):
            return coefficients.float() @ self.basis.T
