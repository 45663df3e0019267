"""The GPU worker path on a real CUDA device: pinned buffers, side streams, bf16 compute weights
narrowed on the device, the codec under CUDA autocast, the measured batch limit.

These run only where a device exists; the same logic runs everywhere on the CPU
(test_transfers.py, test_codec_dtype.py, test_oom_split.py).
"""

from __future__ import annotations

import pytest
import torch

from agora_core.config import OptimizerConfig, RunConfig
from agora_core.config.run import ModelConfig
from agora_core.observability.metrics import NodeMetrics
from agora_worker.model import build_stage
from agora_worker.optimizer import transfers
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend
from agora_worker.serving.compute import build_compute
from agora_worker.settings import WorkerSettings

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = ModelConfig(
    d_model=64, n_heads=2, mlp_ratio=2.0, subspace_rank=8, vocab_size=256, seq_len=16, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="cuda", seed=13, model=MODEL, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1))
CUDA = torch.device("cuda")


def inputs(seed: int, samples: int = 2):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL.vocab_size, (samples, MODEL.seq_len), generator=generator)
    boundary = torch.randn(samples, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
    grad = torch.randn(samples, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
    return tokens, boundary, grad


def train(optimizer: HostOptimizer, steps: int = 3) -> None:
    """Seeded gradients written into the compute copy as a backward writes them: the same on
    either device, so what differs is only how they travel (AdamW runs on the host in both)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        for _microbatch in range(3):
            with optimizer.accumulating(2):
                for p in optimizer.compute:
                    p.grad = torch.randn(p.shape, generator=generator).to(p.device)
        assert optimizer.apply().applied


def test_a_cuda_stage_trains_like_the_cpu_with_one_pinned_transfer_each_way_per_step():
    cpu_module, cuda_module = build_stage(RUN, 1), build_stage(RUN, 1).to(CUDA)
    cpu = HostOptimizer(cpu_module, RUN.optimizer, clip_threshold=1e9)  # no clipping: no norm in play
    gpu = HostOptimizer(cuda_module, RUN.optimizer, clip_threshold=1e9, bucket_bytes=4096)
    engine = gpu.transfers
    assert engine is not None and engine.cuda and len(engine.buckets) > 1
    assert all(m.is_pinned() for m in gpu.master) and all(g.is_pinned() for g in engine.grads)
    train(cpu)
    train(gpu)
    assert (engine.counts.to_host, engine.counts.to_device) == (3, 3)
    torch.cuda.synchronize()
    for c, m, p in zip(cpu.master, gpu.master, gpu.compute, strict=True):
        torch.testing.assert_close(m, c, rtol=1e-6, atol=1e-7)
        assert torch.equal(p.cpu(), m.detach())  # the upload landed


def test_bf16_compute_weights_are_narrowed_on_the_device_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(transfers, "STAGING_BYTES", 4096)  # several staging chunks per tensor
    module = build_stage(RUN, 1).to(CUDA)
    optimizer = HostOptimizer(module, RUN.optimizer, clip_threshold=0.5, compute_dtype=torch.bfloat16)
    backend = StageBackend(module, optimizer, CUDA)
    for i in range(3):
        backend.backward(*inputs(i))
    assert optimizer.apply().applied
    torch.cuda.synchronize()
    for master, compute in zip(optimizer.master, optimizer.compute, strict=True):
        assert compute.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(compute.cpu(), master.detach().to(torch.bfloat16))


def test_under_cuda_autocast_the_codec_rebuilds_the_stream_exactly_in_fp32():
    stage = build_stage(RUN, 1).to(CUDA)
    tokens, _, _ = inputs(0)
    tokens = tokens.to(CUDA)
    coefficients = torch.randn(2, MODEL.seq_len, MODEL.subspace_rank, device=CUDA)
    stream = coefficients @ stage.fixed.basis.T + stage.fixed.fixed_stream(tokens)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        payload = stage.fixed.encode(stream, tokens)
        rebuilt = stage.fixed.decode(payload, tokens)
    assert payload.dtype == rebuilt.dtype == torch.float32
    torch.testing.assert_close(rebuilt, stream, rtol=1e-5, atol=1e-5)


def test_the_cuda_backend_serves_what_the_cpu_computes_within_bf16_autocast():
    results = {}
    for device in (torch.device("cpu"), CUDA):
        module = build_stage(RUN, 1).to(device)
        backend = StageBackend(module, HostOptimizer(module, RUN.optimizer, clip_threshold=1.0), device)
        tokens, boundary, grad = inputs(5)
        results[device.type] = (backend.forward(tokens, boundary), backend.backward(tokens, boundary, grad))
    for gpu, cpu in zip(results["cuda"], results["cpu"], strict=True):
        assert gpu.dtype == torch.float32 and gpu.device.type == "cpu"
        torch.testing.assert_close(gpu, cpu, rtol=5e-2, atol=5e-2)


def test_a_cuda_worker_sizes_its_batch_from_measured_memory_and_the_warm_up_leaves_no_trace():
    compute = build_compute(RUN, 1, WorkerSettings(device="cuda"), NodeMetrics(role="worker"))
    assert compute.max_batch_samples >= 2  # a tiny stage: many samples fit
    assert compute.max_batch_tokens == compute.max_batch_samples * MODEL.seq_len
    optimizer = compute.optimizer
    assert optimizer.samples == 0 and optimizer.total_samples == 0
    assert all(p.grad is None for p in optimizer.compute)
    initial = build_stage(RUN, 1)
    for master, fresh in zip(
        optimizer.master, (p for p in initial.parameters() if p.requires_grad), strict=True
    ):
        assert torch.equal(master.detach(), fresh.detach())  # no step was taken
