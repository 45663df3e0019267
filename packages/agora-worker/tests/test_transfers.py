"""The host <-> device transfer path, run on the CPU with ``separate_master``: the same code a
CUDA worker runs (pinned buffers and side streams aside), checked against one shared copy."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from torch import nn

from agora_core.config import OptimizerConfig, RunConfig
from agora_core.config.run import ModelConfig
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_worker.averaging.segments import FlatParameters, SegmentLayout
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.optimizer.transfers import bucket_indices
from agora_worker.serving.backend import StageBackend
from agora_worker.settings import WorkerSettings
from agora_worker.state.snapshot import StageState
from agora_worker.worker import Worker

MODEL = ModelConfig(
    d_model=32, n_heads=2, mlp_ratio=2.0, subspace_rank=4, vocab_size=256, seq_len=8, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="transfers", seed=7, model=MODEL, optimizer=OptimizerConfig(lr=1e-2, warmup_steps=1))
BUCKET_BYTES = 4096  # several buckets per step even for this small stage


@dataclass
class Replica:
    module: nn.Module
    optimizer: HostOptimizer
    backend: StageBackend
    flat: FlatParameters
    layout: SegmentLayout

    def microbatch(self, seed: int, samples: int) -> torch.Tensor:
        """A body stage's backward on seeded inputs; the gradient for its input boundary."""
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, MODEL.vocab_size, (samples, MODEL.seq_len), generator=generator)
        boundary = torch.randn(samples, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
        grad = torch.randn(samples, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
        return self.backend.backward(tokens, boundary, grad)

    def average(self, round_index: int) -> None:
        """What an averaging round's delta rule does to the masters (Averager._apply)."""
        ranges = self.layout.ranges(round_index)
        rng = np.random.default_rng(round_index)
        delta = rng.normal(0.0, 1e-2, self.layout.length(round_index)).astype(np.float32)
        with self.optimizer.writing_masters():
            self.flat.add(ranges, [(0, delta)])


def replica(*, separate: bool) -> Replica:
    module = build_stage(RUN, 1)
    optimizer = HostOptimizer(
        module, RUN.optimizer, clip_threshold=0.5, separate_master=separate, bucket_bytes=BUCKET_BYTES
    )
    backend = StageBackend(module, optimizer, torch.device("cpu"))
    sizes = [m.numel() for m in optimizer.master]
    layout = SegmentLayout(sizes, segments=4, run_seed=RUN.seed, stage=1, block=64)
    return Replica(module, optimizer, backend, FlatParameters(list(optimizer.master)), layout)


def assert_same_weights(a: Replica, b: Replica) -> None:
    for wa, wb in zip(a.optimizer.master, b.optimizer.master, strict=True):
        torch.testing.assert_close(wa, wb, rtol=1e-5, atol=1e-6)
    for ca, cb in zip(a.optimizer.compute, b.optimizer.compute, strict=True):
        torch.testing.assert_close(ca, cb, rtol=1e-5, atol=1e-6)


def test_buckets_group_consecutive_tensors_up_to_the_byte_limit():
    assert bucket_indices([100, 100, 100, 500, 10], 250) == [[0, 1], [2], [3], [4]]
    assert bucket_indices([], 250) == []


def test_the_separate_master_path_trains_like_one_shared_copy_with_averaging_between():
    shared, separate = replica(separate=False), replica(separate=True)
    assert len(separate.optimizer.transfers.buckets) > 1
    round_index = 0
    for step in range(4):
        for i, samples in enumerate((1, 3, 2)):
            seed = 100 * step + i
            torch.testing.assert_close(
                separate.microbatch(seed, samples), shared.microbatch(seed, samples), rtol=1e-5, atol=1e-7
            )
            if i == 1 and step % 2:  # averaging lands mid-step, gradients pending
                for r in (shared, separate):
                    r.average(round_index)
                round_index += 1
        reports = [r.optimizer.apply() for r in (shared, separate)]
        assert reports[0].applied and reports[1].applied and reports[0].samples == reports[1].samples == 6
        assert reports[1].grad_norm == pytest.approx(reports[0].grad_norm, rel=1e-6)
        if step == 2:  # and between two steps
            for r in (shared, separate):
                r.average(round_index)
            round_index += 1
        assert_same_weights(shared, separate)
    assert separate.optimizer.master[0] is not separate.optimizer.compute[0]


def test_each_step_moves_the_gradients_to_the_host_once_and_the_weights_back_once():
    r = replica(separate=True)
    counts = r.optimizer.transfers.counts
    trained = len(r.optimizer.compute)
    for i in range(5):
        r.microbatch(i, 2)
    # the gradients stay on the compute copy through the step's microbatches
    assert (counts.to_host, counts.to_device, counts.tensors_to_host) == (0, 0, 0)
    assert all(p.grad is not None for p in r.optimizer.compute)
    assert all(m.grad is None for m in r.optimizer.master)
    r.optimizer.apply()
    assert (counts.to_host, counts.to_device) == (1, 1)
    assert (counts.tensors_to_host, counts.tensors_to_device) == (trained, trained)
    assert counts.bytes_to_host == sum(m.numel() * 4 for m in r.optimizer.master)
    assert all(p.grad is None for p in r.optimizer.compute)
    r.average(0)  # averaging's writes reach the compute copy in one transfer
    assert (counts.to_host, counts.to_device) == (1, 2)
    r.optimizer.apply()  # no samples: nothing to move
    r.microbatch(9, 1)
    r.optimizer.compute[0].grad[0] = float("nan")
    assert not r.optimizer.apply().applied  # a dropped gradient moves nothing either
    assert (counts.to_host, counts.to_device) == (1, 2)
    r.microbatch(10, 1)
    r.optimizer.apply()
    assert (counts.to_host, counts.to_device) == (2, 3)


def test_a_snapshot_mid_step_reads_the_masters_and_leaves_the_pending_gradients_alone():
    shared, separate = replica(separate=False), replica(separate=True)
    for r in (shared, separate):
        r.microbatch(1, 2)
        r.optimizer.apply()
        r.microbatch(2, 3)  # pending toward step 2
    snapshots = [StageState(r.module, r.optimizer).capture() for r in (shared, separate)]
    assert snapshots[0].tensors.keys() == snapshots[1].tensors.keys()
    for name, array in snapshots[0].tensors.items():
        np.testing.assert_allclose(snapshots[1].tensors[name], array, rtol=1e-5, atol=1e-6, err_msg=name)
    for r in (shared, separate):
        r.microbatch(3, 1)
        assert r.optimizer.apply().samples == 4  # the snapshot took nothing from the step
    assert_same_weights(shared, separate)


def test_installing_a_state_mid_step_drops_the_pending_gradients_and_updates_the_compute_copy():
    donor = replica(separate=False)
    donor.microbatch(1, 2)
    donor.optimizer.apply()
    snapshot = StageState(donor.module, donor.optimizer).capture()
    joiner = replica(separate=True)
    joiner.microbatch(5, 3)  # gradients of the weights about to be replaced
    StageState(joiner.module, joiner.optimizer).install(snapshot)
    assert joiner.optimizer.samples == 0 and all(p.grad is None for p in joiner.optimizer.compute)
    report = joiner.optimizer.apply()
    assert report.samples == 0 and not report.applied
    assert_same_weights(donor, joiner)  # masters and compute copy alike: the install's upload


def test_bf16_compute_weights_keep_fp32_masters_and_accumulate_gradients_in_fp32():
    torch.manual_seed(0)
    module = nn.Linear(64, 64)
    initial = [p.detach().clone() for p in module.parameters()]
    optimizer = HostOptimizer(module, RUN.optimizer, clip_threshold=1e9, compute_dtype=torch.bfloat16)
    assert optimizer.separate and all(p.dtype == torch.bfloat16 for p in module.parameters())
    for master, value in zip(optimizer.master, initial, strict=True):
        assert master.dtype == torch.float32 and torch.equal(master, value)  # not rounded to bf16
    generator = torch.Generator().manual_seed(1)
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in module.parameters()]
    bf16_running = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in module.parameters()]
    for _ in range(64):  # many microbatches of small gradients, as a large step has
        x = torch.randn(4, 64, generator=generator).to(torch.bfloat16)
        with optimizer.accumulating(4):
            module(x).float().pow(2).sum().backward()
            for total, running, p in zip(exact, bf16_running, module.parameters(), strict=True):
                total += p.grad.double()  # this microbatch's gradient alone, in bf16
                running += p.grad
    norm = math.sqrt(sum(float(t.pow(2).sum()) for t in exact)) / 256
    bf16_norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in bf16_running)) / 256
    report = optimizer.apply()
    assert report.applied and report.grad_norm == pytest.approx(norm, rel=1e-5)
    assert abs(bf16_norm - norm) > 1e-4 * norm  # a bf16 running sum would have drifted this far
    for master, compute in zip(optimizer.master, module.parameters(), strict=True):
        assert torch.equal(compute, master.detach().to(torch.bfloat16))  # the upload narrowed it


def test_bf16_compute_weights_are_refused_on_a_cpu_worker():
    settings = WorkerSettings(device="cpu", compute_weights="bf16", max_batch_samples=4)
    with pytest.raises(ConfigError, match="compute_weights: bf16 compute weights need a CUDA device"):
        Worker(run=RUN, stage=1, key=NodeKey.generate(), settings=settings)
