"""Stage models: the staged SSN transformer equals the same weights run as one module."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from agora_core.config import RunConfig, SurrogateConfig
from agora_core.config.run import ModelConfig
from agora_core.contract import StageRole
from agora_worker.model import ComposedModel, SurrogateStage, TransformerStage, build_stage
from agora_worker.model.subspace import subspace_basis

MODEL = ModelConfig(
    d_model=64,
    n_heads=4,
    mlp_ratio=2.0,
    subspace_rank=8,
    vocab_size=256,
    seq_len=16,
    stage_layers=(1, 2, 1, 1),
)
RUN = RunConfig(seed=7, model=MODEL)


def stages() -> list[TransformerStage]:
    return [build_stage(RUN, s) for s in range(MODEL.n_stages)]


def batch(seed: int = 0, b: int = 3, t: int = 16):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def staged_pass(parts: list[TransformerStage], tokens, labels):
    """What the trainer does: forward stage by stage through the boundary codec, then the
    tail's loss and input gradient, then each earlier stage's backward from its saved input."""
    inputs, outputs = [], []
    boundary = None
    for stage in parts[:-1]:
        x = None if boundary is None else boundary.detach().requires_grad_(True)
        out = stage(tokens) if x is None else stage(tokens, x)
        inputs.append(x)
        outputs.append(out)
        boundary = out
    tail_in = boundary.detach().requires_grad_(True)
    losses = parts[-1](tokens, tail_in, labels)
    losses.sum().backward()
    grad = tail_in.grad
    for x, out in zip(reversed(inputs), reversed(outputs), strict=True):
        torch.autograd.backward(out, grad)
        grad = None if x is None else x.grad
    return losses.detach(), outputs


def test_staged_model_matches_the_whole_model_in_loss_and_gradients():
    parts = stages()
    tokens, labels = batch()
    staged_losses, _ = staged_pass(parts, tokens, labels)
    staged_grads = {name: p.grad.clone() for name, p in ComposedModel(parts).named_parameters()}
    whole = ComposedModel(parts)
    whole.zero_grad(set_to_none=True)
    whole_losses = whole(tokens, labels)
    whole_losses.sum().backward()
    torch.testing.assert_close(staged_losses, whole_losses.detach(), rtol=1e-5, atol=1e-6)
    assert staged_grads.keys() == {n for n, _ in whole.named_parameters()}
    for name, p in whole.named_parameters():
        torch.testing.assert_close(staged_grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_boundary_payload_is_k_over_d_of_the_residual_stream_and_exact():
    parts = stages()
    tokens, _ = batch()
    head = parts[0]
    stream = head.run_blocks(head.embed(tokens))  # (B, T, d)
    payload = head.fixed.encode(stream, tokens)  # (B, T, k)
    assert payload.numel() / stream.numel() == MODEL.subspace_rank / MODEL.d_model
    torch.testing.assert_close(head.fixed.decode(payload, tokens), stream, rtol=1e-5, atol=1e-6)


def test_every_stage_builds_the_same_fixed_parts_and_every_replica_the_same_weights():
    a, b = stages(), stages()
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.fixed.basis, y.fixed.basis) and torch.equal(
            x.fixed.token_table, y.fixed.token_table
        )
        for (nx, px), (ny, py) in zip(x.named_parameters(), y.named_parameters(), strict=True):
            assert nx == ny and torch.equal(px, py)
    basis = a[0].fixed.basis
    torch.testing.assert_close(basis.T @ basis, torch.eye(MODEL.subspace_rank), rtol=0, atol=1e-6)
    assert not torch.equal(subspace_basis(1, 64, 8), subspace_basis(2, 64, 8))  # seeded per run


def test_stage_roles_follow_the_layer_split():
    parts = stages()
    assert [p.role for p in parts] == [StageRole.HEAD, StageRole.BODY, StageRole.BODY, StageRole.TAIL]
    assert [len(p.blocks) for p in parts] == list(MODEL.stage_layers)
    with pytest.raises(ValueError, match="does not exist"):
        build_stage(RUN, 4)


def test_surrogate_stages_speak_the_same_boundary_and_can_fail_on_purpose():
    model = dataclasses.replace(
        MODEL, kind="surrogate", surrogate=SurrogateConfig(dummy_parameters=1000, fail_token=3)
    )
    run = RunConfig(seed=1, model=model)
    parts = [build_stage(run, s) for s in range(model.n_stages)]
    assert all(isinstance(p, SurrogateStage) for p in parts)
    tokens, labels = batch()
    tokens[tokens == 3] = 4
    boundary = parts[0](tokens)
    assert boundary.shape == (3, 16, model.subspace_rank)
    for p in parts[1:-1]:
        boundary = p(tokens, boundary)
    assert parts[-1](tokens, boundary, labels).shape == (3,)
    assert sum(p.numel() for p in parts[1].parameters() if not p.requires_grad) == 1000
    tokens[0, 0] = 3
    with pytest.raises(RuntimeError, match="injected failure"):
        parts[0](tokens)


def test_a_surrogate_batch_holding_the_nan_token_computes_nan_gradients():
    model = dataclasses.replace(MODEL, kind="surrogate", surrogate=SurrogateConfig(nan_token=5))
    body = build_stage(RunConfig(seed=1, model=model), 1)
    tokens, _ = batch()
    tokens[tokens == 5] = 6
    boundary = torch.randn(3, 16, model.subspace_rank)
    body(tokens, boundary).sum().backward()
    assert all(bool(p.grad.isfinite().all()) for p in body.parameters() if p.requires_grad)
    body.zero_grad()
    tokens[1, 2] = 5  # one sample holding it poisons the whole batch, as a broken device would
    out = body(tokens, boundary)
    out.sum().backward()
    assert bool(out.isnan().all()) and bool(body.linear.weight.grad.isnan().all())
