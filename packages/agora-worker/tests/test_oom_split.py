"""A microbatch that runs out of device memory is split and retried; no sample counts twice.

The stage here is a stand-in whose backward raises torch's out-of-memory error for batches
above a size, after part of its gradients were already written: what a real device does
halfway through a backward. Everything around it is real: runtime, backend, optimizer.
"""

from __future__ import annotations

import asyncio

import numpy as np
import torch
from torch import nn

from agora_core.config import OptimizerConfig
from agora_core.contract import StageRole
from agora_devkit.processes import wait_until_async
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend
from agora_worker.serving.runtime import Op, Runtime

K, T = 4, 3


class OutOfMemoryAbove(torch.autograd.Function):
    """Identity forward; its backward fails like a full device for more than ``limit`` samples."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, limit: int) -> torch.Tensor:
        ctx.limit = limit
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if grad.shape[0] > ctx.limit:
            raise torch.cuda.OutOfMemoryError(f"injected: {grad.shape[0]} samples > {ctx.limit}")
        return grad, None


class FullDeviceStage(nn.Module):
    """A body stage of two layers; the layer nearer the output gets its gradients first."""

    role = StageRole.BODY
    boundary_width = K

    def __init__(self, limit: int):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(K, K)
        self.second = nn.Linear(K, K)
        self.limit = limit

    def forward(self, tokens, boundary, labels=None):
        x = OutOfMemoryAbove.apply(torch.tanh(self.first(boundary)), self.limit)
        return x + torch.tanh(self.second(x))

    def delay(self, direction: str, samples: int) -> None:
        """No injected compute time."""


def request(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "tokens": np.zeros((1, T), dtype=np.int64),
        "boundary": rng.standard_normal((1, T, K), dtype=np.float32),
        "grad": rng.standard_normal((1, T, K), dtype=np.float32),
    }


async def test_an_out_of_memory_backward_is_split_and_each_sample_counts_once():
    module = FullDeviceStage(limit=2)
    optimizer = HostOptimizer(module, OptimizerConfig(), clip_threshold=1.0)
    runtime = Runtime(
        StageBackend(module, optimizer, torch.device("cpu")),
        max_batch_samples=8,
        max_batch_tokens=100,
        min_batch_samples=8,  # all six in one microbatch, not half of them
    )
    requests = [request(seed) for seed in range(6)]
    waits = [asyncio.create_task(runtime.submit(Op.BACKWARD, r)) for r in requests]
    await wait_until_async(lambda: runtime.queued_samples == 6, what="six queued requests")
    runtime.start()  # all six wait: they form one microbatch
    try:
        results = await asyncio.gather(*waits)
    finally:
        runtime.stop()

    reference = FullDeviceStage(limit=6)  # the same weights, memory enough for all six at once
    boundary = torch.from_numpy(np.concatenate([r["boundary"] for r in requests])).requires_grad_(True)
    out = reference(None, boundary)
    torch.autograd.backward(out, torch.from_numpy(np.concatenate([r["grad"] for r in requests])))

    assert list(runtime.batch_sizes) == [6] and runtime.samples_processed == 6
    assert optimizer.samples == 6 and optimizer.total_samples == 6  # counted once each
    assert runtime.oom_splits == 3  # 6 -> 3 + 3, each 3 -> 2 + 1
    assert (runtime.max_batch_samples, runtime.max_batch_tokens) == (2, 2 * T)  # the next batches fit
    for p, q in zip(module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)  # not double-counted
    for i, result in enumerate(results):
        np.testing.assert_allclose(result["grad"], boundary.grad[i : i + 1].numpy(), rtol=1e-5, atol=1e-7)


async def test_a_single_sample_that_runs_out_of_memory_fails_alone_and_counts_nothing():
    module = FullDeviceStage(limit=0)
    optimizer = HostOptimizer(module, OptimizerConfig(), clip_threshold=1.0)
    runtime = Runtime(
        StageBackend(module, optimizer, torch.device("cpu")),
        max_batch_samples=8,
        max_batch_tokens=100,
        min_batch_samples=8,  # all six in one microbatch, not half of them
    )
    runtime.start()
    try:
        result = await asyncio.gather(runtime.submit(Op.BACKWARD, request(0)), return_exceptions=True)
    finally:
        runtime.stop()
    assert isinstance(result[0], torch.cuda.OutOfMemoryError)
    assert runtime.failed_requests == 1 and optimizer.samples == 0
    assert all(p.grad is None for p in module.parameters())  # the half-written gradients went
