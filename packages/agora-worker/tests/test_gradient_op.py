"""The ``gradient`` op a trainer's spot check asks of a second replica: what a backward (or the
tail's ``forward_backward``) returns, computed without training. Real stages of a small
transformer, real backend and optimizer."""

from __future__ import annotations

import torch

from agora_core.config import RunConfig
from agora_core.config.run import ModelConfig
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend

MODEL = ModelConfig(
    d_model=64, n_heads=2, mlp_ratio=2.0, subspace_rank=8, vocab_size=256, seq_len=16, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="gradient-op", seed=5, model=MODEL)


def backend_of(stage: int) -> tuple[StageBackend, HostOptimizer]:
    module = build_stage(RUN, stage)
    optimizer = HostOptimizer(module, RUN.optimizer, clip_threshold=1.0)
    return StageBackend(module, optimizer, torch.device("cpu")), optimizer


def inputs(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
    boundary = torch.randn(2, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
    grad = torch.randn(2, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
    return tokens, boundary, grad


def test_a_body_stages_gradient_is_its_backwards_input_gradient_and_trains_nothing():
    backend, optimizer = backend_of(1)
    tokens, boundary, grad = inputs()
    found = backend.gradient(tokens, boundary, grad=grad)
    assert set(found) == {"grad"} and found["grad"].shape == boundary.shape
    assert optimizer.samples == 0 and all(p.grad is None for p in backend.module.parameters())
    returned = backend.backward(tokens, boundary, grad)  # the same question, training
    torch.testing.assert_close(found["grad"], returned)
    assert optimizer.samples == 2  # only the backward counted


def test_the_tails_gradient_is_its_forward_backwards_losses_and_input_gradient_without_training():
    backend, optimizer = backend_of(2)
    tokens, boundary, _ = inputs(1)
    labels = torch.roll(tokens, -1, dims=1)
    found = backend.gradient(tokens, boundary, labels=labels)
    assert optimizer.samples == 0 and all(p.grad is None for p in backend.module.parameters())
    losses, grad = backend.forward_backward(tokens, boundary, labels)
    torch.testing.assert_close(found["loss"], losses)
    torch.testing.assert_close(found["grad"], grad)
