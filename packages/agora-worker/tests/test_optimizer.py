"""The host-side optimizer: schedule, stage-wise clipping, accumulation, master copies."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from agora_core.config import ClippingConfig, OptimizerConfig
from agora_worker.optimizer import HostOptimizer, learning_rate

CONFIG = OptimizerConfig(lr=1e-2, min_lr_ratio=0.1, warmup_steps=10, total_steps=110, target_batch_size=4)


def test_learning_rate_warms_up_then_decays_to_its_floor():
    assert learning_rate(0, CONFIG) == pytest.approx(1e-3)
    assert learning_rate(9, CONFIG) == pytest.approx(1e-2)
    assert learning_rate(60, CONFIG) == pytest.approx(1e-3 + 0.5 * 9e-3)
    assert learning_rate(110, CONFIG) == pytest.approx(1e-3)
    assert learning_rate(10_000, CONFIG) == pytest.approx(1e-3)


@pytest.mark.parametrize(("stage", "expected"), [(0, 0.5), (1, 0.5), (2, 0.5), (3, 1.0)])
def test_stage_wise_clipping_thresholds(stage, expected):
    # a unit budget split over S = 4 stages: 1/sqrt(4) each, twice that for the tail
    assert ClippingConfig().threshold(stage, 4) == pytest.approx(expected)


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def backward(module: nn.Module, optimizer: HostOptimizer, scale: float = 1.0, samples: int = 2) -> None:
    x = torch.linspace(-1, 1, 4 * samples).view(samples, 4)
    (module(x).sum() * scale).backward()
    optimizer.accumulate(samples)


def test_gradients_are_averaged_over_samples_and_clipped_to_the_threshold():
    module = model()
    optimizer = HostOptimizer(module, CONFIG, clip_threshold=0.5)
    seen = {}
    step = optimizer.adamw.step

    def spy():  # the gradient AdamW is handed, after averaging and clipping
        seen["norm"] = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in module.parameters()))
        step()

    optimizer.adamw.step = spy
    backward(module, optimizer, scale=100.0, samples=2)
    backward(module, optimizer, scale=100.0, samples=3)
    report = optimizer.apply()
    assert report.samples == 5 and report.step == 1 and report.applied
    assert report.grad_norm > 0.5  # what it was, before clipping
    assert seen["norm"] == pytest.approx(0.5, rel=1e-4)  # what it became
    assert all(p.grad is None for p in module.parameters())
    assert optimizer.samples == 0


def test_a_host_master_copy_trains_exactly_like_in_place_weights():
    a, b = model(1), model(1)
    in_place = HostOptimizer(a, CONFIG, clip_threshold=0.5)
    mirrored = HostOptimizer(b, CONFIG, clip_threshold=0.5, separate_master=True)
    assert mirrored.master[0] is not mirrored.compute[0]
    for scale in (1.0, 3.0, 0.2):
        backward(a, in_place, scale)
        backward(b, mirrored, scale)
        in_place.apply()
        mirrored.apply()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=1e-7)


def test_steps_without_samples_or_with_bad_gradients_change_nothing():
    module = model()
    before = [p.detach().clone() for p in module.parameters()]
    optimizer = HostOptimizer(module, CONFIG, clip_threshold=0.5)
    report = optimizer.apply()
    assert report.step == 1 and not report.applied
    backward(module, optimizer)
    next(module.parameters()).grad[0, 0] = float("nan")
    report = optimizer.apply()
    assert report.step == 2 and not report.applied and not math.isfinite(report.grad_norm)
    for p, q in zip(module.parameters(), before, strict=True):
        assert torch.equal(p, q)
    assert optimizer.nonfinite_in_a_row == 1  # what the self-termination rule counts
    backward(module, optimizer)
    assert optimizer.apply().applied and optimizer.nonfinite_in_a_row == 0  # a good step resets it
