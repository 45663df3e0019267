"""Pre-norm transformer blocks whose output projections live in the shared subspace.

Shapes: B batch, T tokens, d model width, k subspace rank, h heads, f MLP width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from agora_core.config.run import ModelConfig
from agora_worker.model.seeding import normal
from agora_worker.model.subspace import full_precision

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SubspaceProjection(nn.Module):
    """y = x Z U^T: a (in -> d) projection whose output always lies in span(U). Z is trained;
    U (d, k) belongs to the stage and is passed in, so every block shares one copy. The last
    product runs in fp32 under autocast: a bf16 one would round y off the subspace, and the
    boundary codec would drop what lies outside it."""

    def __init__(self, z: torch.Tensor):
        super().__init__()
        self.z = nn.Parameter(z)  # (in, k)

    def forward(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        coefficients = x @ self.z  # (.., in) -> (.., k), in the blocks' compute dtype
        with full_precision(coefficients):  # (.., k) -> (.., d): in span(U) to fp32 rounding
            return coefficients.float() @ basis.T


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, name: str, out_std: float):
        super().__init__()
        d, k = config.d_model, config.subspace_rank
        self.n_heads = config.n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        with torch.no_grad():
            self.qkv.weight.copy_(normal((3 * d, d), INIT_STD, seed, f"{name}.qkv"))
        self.out = SubspaceProjection(normal((d, k), out_std, seed, f"{name}.out"))

    def forward(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)  # 3 x (B, T, d)
        q, k, v = (
            z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v)
        )  # (B, h, T, d/h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, d/h)
        return self.out(y.transpose(1, 2).reshape(b, t, d), basis)  # (B, T, d) in span(U)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, seed: int, name: str, out_std: float):
        super().__init__()
        d, k = config.d_model, config.subspace_rank
        hidden = int(config.mlp_ratio * d)
        self.up = nn.Linear(d, hidden, bias=False)
        with torch.no_grad():
            self.up.weight.copy_(normal((hidden, d), INIT_STD, seed, f"{name}.up"))
        self.down = SubspaceProjection(normal((hidden, k), out_std, seed, f"{name}.down"))

    def forward(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)), basis)  # (B, T, d) -> (B, T, f) -> (B, T, d) in span(U)


class Block(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). ``layer`` is its index in the whole model, so
    its weights are the same whichever stage (or reference) builds it."""

    def __init__(self, config: ModelConfig, seed: int, layer: int):
        super().__init__()
        # GPT-2's scaled init for projections into the residual stream.
        out_std = INIT_STD / math.sqrt(2 * config.n_layers)
        self.norm1 = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(config, seed, f"layer{layer}.attn", out_std)
        self.norm2 = RMSNorm(config.d_model)
        self.mlp = MLP(config, seed, f"layer{layer}.mlp", out_std)

    def forward(self, x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), basis)
        return x + self.mlp(self.norm2(x), basis)
