"""Runs one stage's forward and backward passes on its device (one compute thread calls it).

A backward pass recomputes the stage's forward from the input the trainer sends back: the
worker keeps no per-request state between a sample's forward and its backward, so any request
can be served in any order and a worker can vanish at any time. It recomputes under the
weights the forward used while they are kept (``versions``), else under the current ones.

On CUDA the blocks compute under bf16 autocast; the boundary codec runs in fp32 whatever the
blocks do (``model.subspace``), and what leaves the stage (its output boundary, the gradient
for its input boundary) leaves in ``boundary_dtype``, the run's ``transport.boundary_dtype``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import nn

from agora_core.config.run import STALE_GRADIENTS
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.versions import WeightVersions


def pick_device(name: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


BOUNDARY_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # transport.boundary_dtype


class StageBackend:
    def __init__(
        self,
        module: nn.Module,
        optimizer: HostOptimizer,
        device: torch.device,
        *,
        boundary_dtype: torch.dtype = torch.float32,
        weight_versions: int = 0,
        stale_gradients: str = "apply",
    ):
        """``weight_versions``: weight copies kept for backwards (the run's
        ``optimizer.weight_versions``); ``stale_gradients``: "drop" keeps no weight gradient
        of a backward whose kept weights are an earlier step's, "apply" keeps it (the run's
        ``optimizer.stale_gradients``)."""
        if stale_gradients not in STALE_GRADIENTS:
            raise ValueError(f"stale_gradients must be one of {STALE_GRADIENTS}, not {stale_gradients!r}")
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.boundary_dtype = boundary_dtype
        self.versions = WeightVersions(optimizer.compute, keep=weight_versions)
        self.drop_stale = stale_gradients == "drop"
        self.dropped_samples = 0  # backward samples whose stale weight gradient was dropped

    def _autocast(self):
        if self.device.type == "cuda":  # bf16 compute on accelerators, fp32 master weights on the host
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device, non_blocking=True)

    def _leaf(self, boundary: torch.Tensor) -> torch.Tensor:
        """The input boundary on the device as a leaf of its own, whose gradient the backward
        fills (never the caller's tensor: on the CPU ``.to`` returns that very tensor)."""
        return self._to_device(boundary).detach().requires_grad_(True)

    def _outgoing(self, boundary: torch.Tensor) -> torch.Tensor:
        """A boundary payload or its gradient as it leaves: narrowed on the device, then copied."""
        return boundary.detach().to(self.boundary_dtype).cpu()

    def mark_version(self) -> int:
        """The name of the weights the next forward runs under (a backward sends it back)."""
        return self.versions.mark(self.optimizer.step)

    def forward(self, tokens: torch.Tensor, boundary: torch.Tensor | None) -> torch.Tensor:
        """Head/body: the output boundary (B, T, k). Tail: logits are not served; use labels."""
        with torch.no_grad(), self._autocast():
            out = self.module(self._to_device(tokens), self._to_device(boundary))
        self.module.delay("forward", tokens.shape[0])
        return self._outgoing(out)

    def evaluate(self, tokens: torch.Tensor, boundary: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Tail without training: per-sample losses (B,)."""
        with torch.no_grad(), self._autocast():
            losses = self.module(self._to_device(tokens), self._to_device(boundary), self._to_device(labels))
        self.module.delay("forward", tokens.shape[0])
        return losses.float().cpu()

    def weights_of_each(self, versions: Sequence[int | None]) -> list[int]:
        """Which weights a backward of each version's forward recomputes under, as of one
        moment (``WeightVersions.weights_of_each``): backwards of one answer may share a batch."""
        return self.versions.weights_of_each(versions)

    def backward(
        self,
        tokens: torch.Tensor,
        boundary: torch.Tensor | None,
        grad: torch.Tensor,
        *,
        versions: Sequence[int | None] | None = None,
    ) -> torch.Tensor | None:
        """Recompute the forward (under the weights each sample's forward ran under, named in
        ``versions`` per sample as the forwards' replies gave them, while kept; one
        ``weights_of_each`` answer for all), backpropagate ``grad`` (B, T, k) from the output,
        accumulate parameter gradients; returns the gradient for the input boundary (None for
        the head). Under an earlier step's weights with ``drop_stale``, only the input's
        gradient is taken (none at all at the head); the samples still count toward the step."""
        inputs = None if boundary is None else self._leaf(boundary)
        samples = tokens.shape[0]
        names = [None] * samples if versions is None else list(versions)
        if len(names) != samples:
            raise ValueError(f"{len(names)} versions named for {samples} samples")
        with (
            self.versions.using(names, step=self.optimizer.step) as stale,
            self.optimizer.accumulating(samples),  # nothing counts if it fails halfway
        ):
            if stale and self.drop_stale:
                found = None if inputs is None else self._input_gradient(tokens, inputs, grad)
                self.dropped_samples += samples
                return None if found is None else self._outgoing(found)
            with torch.enable_grad(), self._autocast():
                out = self.module(self._to_device(tokens), inputs)
            torch.autograd.backward(out, self._to_device(grad).to(out.dtype))
            self.module.delay("backward", tokens.shape[0])
        return None if inputs is None else self._outgoing(inputs.grad)

    def _input_gradient(self, tokens: torch.Tensor, inputs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The gradient for the input boundary of the stage's output gradient ``grad``, with no
        parameter gradient accumulated."""
        with torch.enable_grad(), self._autocast():
            out = self.module(self._to_device(tokens), inputs)
            (found,) = torch.autograd.grad(out, inputs, self._to_device(grad).to(out.dtype))
        self.module.delay("forward", tokens.shape[0])
        self.module.delay("backward", tokens.shape[0])
        return found

    def gradient(
        self,
        tokens: torch.Tensor,
        boundary: torch.Tensor,
        *,
        grad: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """What a backward (body: ``grad`` given) or ``forward_backward`` (tail: ``labels``)
        returns, computed without training: the input gradient, and the tail's per-sample
        losses. Only the input's gradient is taken, so no parameter gradient accumulates."""
        inputs = self._leaf(boundary)
        if labels is None:
            return {"grad": self._outgoing(self._input_gradient(tokens, inputs, grad))}
        with torch.enable_grad(), self._autocast():
            losses = self.module(self._to_device(tokens), inputs, self._to_device(labels))
            (found,) = torch.autograd.grad(losses.sum(), inputs)
        self.module.delay("forward", tokens.shape[0])
        self.module.delay("backward", tokens.shape[0])
        return {"loss": losses.detach().float().cpu(), "grad": self._outgoing(found)}

    def forward_backward(
        self, tokens: torch.Tensor, boundary: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tail: per-sample losses (B,) and the gradient for the input boundary, in one pass."""
        inputs = self._leaf(boundary)
        with self.optimizer.accumulating(tokens.shape[0]):  # nothing counts if it fails halfway
            with torch.enable_grad(), self._autocast():
                losses = self.module(self._to_device(tokens), inputs, self._to_device(labels))
            losses.sum().backward()  # each sample's own loss: batch members do not interact
            self.module.delay("forward", tokens.shape[0])
            self.module.delay("backward", tokens.shape[0])
        return losses.detach().float().cpu(), self._outgoing(inputs.grad)
