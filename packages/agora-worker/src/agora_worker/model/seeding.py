"""Deterministic, per-tensor random streams derived from the run seed.

Every replica of a stage, the centralized reference, and every stage's view of the shared
fixed parts (the subspace basis, the fixed token table) must draw identical numbers. Each
tensor therefore gets its own generator seeded from (run seed, tensor name), independent of
the order in which modules are built.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


def generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, name))


def normal(shape: tuple[int, ...], std: float, seed: int, name: str) -> torch.Tensor:
    """N(0, std^2) in float32, drawn in float64 on the CPU so every machine agrees."""
    return (torch.randn(shape, generator=generator(seed, name), dtype=torch.float64) * std).float()
