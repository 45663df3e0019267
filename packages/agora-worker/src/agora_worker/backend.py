"""Runs one stage's forward and backward passes on its device (one compute thread calls it).

A backward pass recomputes the stage's forward from the input the trainer sends back, under
the worker's current weights: the worker keeps nothing between a sample's forward and its
backward, so any request can be served in any order and a worker can vanish at any time.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from agora_worker.optimizer import HostOptimizer


def pick_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


class StageBackend:
    def __init__(self, module: nn.Module, optimizer: HostOptimizer, device: torch.device):
        self.module = module
        self.optimizer = optimizer
        self.device = device

    def _autocast(self):
        if self.device.type == "cuda":  # bf16 compute on accelerators, fp32 master weights on the host
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device, non_blocking=True)

    def forward(self, tokens: torch.Tensor, boundary: torch.Tensor | None) -> torch.Tensor:
        """Head/body: the output boundary (B, T, k). Tail: logits are not served; use labels."""
        with torch.no_grad(), self._autocast():
            out = self.module(self._to_device(tokens), self._to_device(boundary))
        self.module.delay("forward", tokens.shape[0])
        return out.float().cpu()

    def evaluate(self, tokens: torch.Tensor, boundary: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Tail without training: per-sample losses (B,)."""
        with torch.no_grad(), self._autocast():
            losses = self.module(self._to_device(tokens), self._to_device(boundary), self._to_device(labels))
        self.module.delay("forward", tokens.shape[0])
        return losses.float().cpu()

    def backward(
        self, tokens: torch.Tensor, boundary: torch.Tensor | None, grad: torch.Tensor
    ) -> torch.Tensor | None:
        """Recompute the forward, backpropagate ``grad`` (B, T, k) from the output, accumulate
        parameter gradients; returns the gradient for the input boundary (None for the head)."""
        inputs = None if boundary is None else self._to_device(boundary).requires_grad_(True)
        with torch.enable_grad(), self._autocast():
            out = self.module(self._to_device(tokens), inputs)
        torch.autograd.backward(out, self._to_device(grad).to(out.dtype))
        self.module.delay("backward", tokens.shape[0])
        self.optimizer.accumulate(tokens.shape[0])
        return None if inputs is None else inputs.grad.float().cpu()

    def forward_backward(
        self, tokens: torch.Tensor, boundary: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tail: per-sample losses (B,) and the gradient for the input boundary, in one pass."""
        inputs = self._to_device(boundary).requires_grad_(True)
        with torch.enable_grad(), self._autocast():
            losses = self.module(self._to_device(tokens), inputs, self._to_device(labels))
        losses.sum().backward()  # each sample's own loss: batch members do not interact
        self.module.delay("forward", tokens.shape[0])
        self.module.delay("backward", tokens.shape[0])
        self.optimizer.accumulate(tokens.shape[0])
        return losses.detach().float().cpu(), inputs.grad.float().cpu()
