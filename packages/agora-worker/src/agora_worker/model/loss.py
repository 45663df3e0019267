"""The training loss every tail computes, transformer or surrogate."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_sample_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each sample. (B, T, V), (B, T) -> (B,)"""
    b, t, v = logits.shape
    losses = F.cross_entropy(logits.reshape(b * t, v).float(), labels.reshape(b * t), reduction="none")
    return losses.view(b, t).mean(dim=1)
