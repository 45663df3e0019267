"""The host-side optimizer: schedule, stage-wise clipping, accumulation, master copies."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from agora_core.config import ClippingConfig, OptimizerConfig
from agora_worker.optimizer.host import HostOptimizer, adam_ratio_bound, learning_rate

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


def moments(optimizer: HostOptimizer) -> list[torch.Tensor]:
    return [t.clone() for state in optimizer.adamw.state.values() for t in state.values()]


@pytest.mark.parametrize("separate_master", [False, True])
def test_a_warmup_step_moves_the_moments_and_leaves_the_weights(separate_master):
    module = model()
    optimizer = HostOptimizer(module, CONFIG, clip_threshold=0.5, separate_master=separate_master)
    backward(module, optimizer)
    optimizer.apply()
    weights, held = [p.detach().clone() for p in module.parameters()], moments(optimizer)
    backward(module, optimizer, scale=2.0)
    report = optimizer.apply(warmup=True)
    assert report.applied and report.warmup and report.step == 2 and report.update_ratio > 0
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights, strict=True))
    assert all(torch.equal(p, w) for p, w in zip(optimizer.master, weights, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(moments(optimizer), held, strict=True))
    backward(module, optimizer)
    assert not optimizer.apply().warmup  # and the next full step moves them again
    assert not all(torch.equal(p, w) for p, w in zip(module.parameters(), weights, strict=True))


def test_adamw_never_exceeds_its_ratio_bound_whatever_the_gradients():
    # The guard's a-priori reference: |m^| / sqrt(v^) over any gradient history, bias-corrected.
    bound = adam_ratio_bound(CONFIG.betas)
    b1, b2 = CONFIG.betas
    assert bound == pytest.approx((1 - b1) / math.sqrt((1 - b2) * (1 - b1 * b1 / b2)))
    generator = torch.Generator().manual_seed(7)

    def worst_ratio(gradients) -> float:
        param = nn.Parameter(torch.zeros(4096))
        adamw = torch.optim.AdamW([param], lr=0.0, betas=(b1, b2), eps=1e-30)
        worst = 0.0
        for t, grad in enumerate(gradients, start=1):
            param.grad = grad
            adamw.step()
            state = adamw.state[param]
            m_hat, v_hat = state["exp_avg"] / (1 - b1**t), state["exp_avg_sq"] / (1 - b2**t)
            worst = max(worst, float((m_hat.abs() / v_hat.sqrt().clamp_min(1e-30)).max()))
        return worst

    # bursts, sign flips, quiet stretches and sudden jumps
    noisy = [
        torch.randn(4096, generator=generator, dtype=torch.float64).float()
        * float(torch.rand((), generator=generator)) ** 8
        * 10.0 ** (t % 7 - 3)
        for t in range(200)
    ]
    assert worst_ratio(noisy) <= bound * (1 + 1e-5)
    # the history that attains it: each gradient b2 / b1 times the one before
    growing = [torch.full((4096,), (b2 / b1) ** t) for t in range(300)]
    assert bound * 0.99 < worst_ratio(growing) <= bound * (1 + 1e-5)


def test_a_step_from_moments_no_adamw_could_hold_is_refused_and_changes_nothing():
    # A second moment lost (or taken from another replica that never saw these weights move):
    # m / sqrt(v) explodes, and one such step once wrecked a tail stage.
    module = model()
    optimizer = HostOptimizer(module, CONFIG, clip_threshold=0.5)
    backward(module, optimizer)
    optimizer.apply()
    for state in optimizer.adamw.state.values():
        state["exp_avg_sq"].zero_()
    weights, held = [p.detach().clone() for p in module.parameters()], moments(optimizer)
    backward(module, optimizer)
    for p in module.parameters():  # rows this batch did not touch (an embedding's absent tokens)
        p.grad[: len(p.grad) // 2] = 0
    report = optimizer.apply()
    assert not report.applied and "consistent AdamW" in report.refused and report.step == 2
    assert report.update_ratio > CONFIG.max_update_ratio * adam_ratio_bound(CONFIG.betas)
    assert all(torch.equal(p, w) for p, w in zip(module.parameters(), weights, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(moments(optimizer), held, strict=True))
    assert optimizer.refused_steps == 1 and optimizer.nonfinite_in_a_row == 0  # not a NaN gradient
    off = HostOptimizer(model(), dataclasses.replace(CONFIG, max_update_ratio=0.0), clip_threshold=0.5)
    assert off.refusal(1e9) == ""  # 0 turns the guard off


def test_a_step_far_beyond_the_recent_ones_is_refused_once_there_are_enough_of_them():
    optimizer = HostOptimizer(model(), CONFIG, clip_threshold=0.5)
    optimizer.recent_ratios.extend([0.2, 0.25, 0.2])
    assert optimizer.refusal(3.0) == ""  # too few steps: the a-priori bound (x4) decides
    assert optimizer.refusal(5.0)
    optimizer.recent_ratios.append(0.3)
    assert optimizer.refusal(0.8) == ""  # under 4x the median 0.225
    assert "median of its last 4 steps" in optimizer.refusal(0.95)
    assert optimizer.refusal(float("nan"))
