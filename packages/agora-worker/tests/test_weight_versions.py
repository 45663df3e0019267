"""A backward recomputes under the weights its forward used, while they are kept.

A real backend, optimizer and stage module (two linear layers): a forward names its weights,
the stage steps, and the sample's backward must give exactly the gradients a backward under
the old weights gives, leave the live weights in place, and count how it ran.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from agora_core.config import OptimizerConfig
from agora_core.contract import StageRole
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend
from agora_worker.serving.versions import LIVE

K, T = 4, 3
CONFIG = dataclasses.replace(OptimizerConfig(), lr=0.1, warmup_steps=0)


class Body(nn.Module):
    role = StageRole.BODY
    boundary_width = K

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(K, K)
        self.second = nn.Linear(K, K)
        self.fail = False

    def forward(self, tokens, boundary, labels=None):
        if self.fail:
            raise RuntimeError("injected failure mid-backward")
        return self.second(torch.tanh(self.first(boundary)))

    def delay(self, direction: str, samples: int) -> None:
        """No injected compute time."""


def backend(keep: int, stale_gradients: str = "apply") -> StageBackend:
    module = Body()
    optimizer = HostOptimizer(module, CONFIG, clip_threshold=10.0)
    return StageBackend(
        module, optimizer, torch.device("cpu"), weight_versions=keep, stale_gradients=stale_gradients
    )


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.zeros(1, T, dtype=torch.int64),
        torch.randn(1, T, K, generator=generator),
        torch.randn(1, T, K, generator=generator),
    )


def weights(b: StageBackend) -> list[torch.Tensor]:
    return [p.detach().clone() for p in b.optimizer.compute]


def grads(b: StageBackend) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in b.optimizer.compute]


def step(b: StageBackend, seed: int) -> None:
    """Train the stage one step on another sample (forward and backward at once): its
    weights change."""
    tokens, boundary, grad = inputs(seed)
    b.backward(tokens, boundary, grad, versions=[b.mark_version()])
    assert b.optimizer.apply().applied


def test_a_backward_after_a_step_recomputes_under_its_forwards_weights():
    b = backend(keep=2)
    tokens, boundary, grad = inputs(1)
    name = b.mark_version()  # the forward's
    b.forward(tokens, boundary)
    before = weights(b)
    # what the backward gives right away, on a twin that never steps
    twin = backend(keep=2)
    expected_input_grad = twin.backward(tokens, boundary, grad)
    expected = grads(twin)
    step(b, seed=2)
    after = weights(b)
    assert any(not torch.equal(x, y) for x, y in zip(before, after, strict=True))
    input_grad = b.backward(tokens, boundary, grad, versions=[name])
    assert torch.allclose(input_grad, expected_input_grad)
    assert all(torch.allclose(g, e) for g, e in zip(grads(b), expected, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(weights(b), after, strict=True))  # live weights back
    assert (b.versions.kept_samples, b.versions.live_samples, b.versions.missed_samples) == (1, 1, 0)
    assert b.versions.take_staleness() == [(0, 1), (1, 1)]  # the training sample's, then this one's
    assert b.mark_version() != name  # the step made a new version


def test_a_stale_backward_passes_its_input_gradient_on_and_drops_its_weight_gradient():
    b = backend(keep=2, stale_gradients="drop")
    tokens, boundary, grad = inputs(1)
    name = b.mark_version()  # the forward's, at step 0
    twin = backend(keep=2)
    expected_input_grad = twin.backward(tokens, boundary, grad)
    step(b, seed=2)
    input_grad = b.backward(tokens, boundary, grad, versions=[name])  # lands in step 1: stale
    assert torch.allclose(input_grad, expected_input_grad)
    assert all(p.grad is None or not p.grad.any() for p in b.optimizer.compute)
    assert (b.optimizer.samples, b.dropped_samples) == (1, 1)  # it still counts toward the step
    # weights written in place without a step (an averaging round's delta): not stale
    same_step = b.mark_version()
    with torch.no_grad():
        b.optimizer.compute[0].add_(0.01)
    assert b.weights_of_each([same_step]) == [same_step]
    b.backward(tokens, boundary, grad, versions=[same_step])
    assert any(p.grad is not None and p.grad.any() for p in b.optimizer.compute)
    assert (b.optimizer.samples, b.dropped_samples) == (2, 1)
    with pytest.raises(ValueError, match="stale_gradients"):
        backend(keep=2, stale_gradients="sometimes")


def test_without_kept_weights_or_with_a_foreign_name_the_live_weights_are_used():
    b = backend(keep=0)
    tokens, boundary, grad = inputs(1)
    name = b.mark_version()
    step(b, seed=2)
    twin = backend(keep=0)
    step(twin, seed=2)
    expected = twin.backward(tokens, boundary, grad)  # under the stepped weights
    assert torch.allclose(b.backward(tokens, boundary, grad, versions=[name]), expected)
    assert torch.allclose(b.backward(tokens, boundary, grad, versions=[12345]), expected)  # never given
    assert b.versions.missed_samples == 2
    assert b.versions.take_staleness() == [(0, 1), (1, 1)]  # a name it never gave has no step


def test_only_the_newest_versions_are_kept_and_a_failed_backward_restores_the_live_weights():
    b = backend(keep=1)
    tokens, boundary, grad = inputs(1)
    first = b.mark_version()
    step(b, seed=2)
    second = b.mark_version()
    step(b, seed=3)
    live = weights(b)
    b.backward(tokens, boundary, grad, versions=[first])  # aged out: live weights
    assert b.versions.missed_samples == 1 and b.versions.kept_samples == 0
    b.optimizer.discard_gradients()
    b.module.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        b.backward(tokens, boundary, grad, versions=[second])  # kept, swapped in, then it fails
    assert all(torch.equal(x, y) for x, y in zip(weights(b), live, strict=True))
    assert b.optimizer.samples == 0  # nothing of the failed backward counts


def test_backwards_batch_by_the_weights_they_recompute_under_and_each_sample_counts_by_its_name():
    b = backend(keep=2)
    tokens, boundary, grad = inputs(1)
    gone = b.mark_version()
    step(b, seed=2)
    kept = b.mark_version()
    step(b, seed=3)
    live = b.mark_version()  # the second copy kept: gone's aged out
    b.versions.take_staleness()
    counted = lambda: (b.versions.kept_samples, b.versions.live_samples, b.versions.missed_samples)  # noqa: E731
    before = counted()
    # gone aged out and live is live: both recompute under the live weights, so they are one kind
    assert b.weights_of_each([gone, live, None, kept]) == [LIVE, LIVE, LIVE, kept]
    two = (torch.cat([tokens, tokens]), torch.cat([boundary, boundary]), torch.cat([grad, grad]))
    b.backward(*two, versions=[gone, live])
    assert [n - m for n, m in zip(counted(), before, strict=True)] == [0, 1, 1]
    assert b.versions.take_staleness() == [(2, 1), (0, 1)]
    before = weights(b)
    with pytest.raises(ValueError, match="mixes"):
        b.backward(*two, versions=[kept, live])
    assert all(torch.equal(x, y) for x, y in zip(weights(b), before, strict=True))
    with pytest.raises(ValueError, match="2 samples"):
        b.backward(*two, versions=[live])
