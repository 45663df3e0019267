"""The boundary codec in fp32 whatever the blocks compute in, and the boundary's wire dtype.

CPU autocast to bf16 stands in for a GPU's: the same ops narrow under it, so a codec that let
autocast in would lose its exactness here too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from agora_core.config import RunConfig, parse_run_config
from agora_core.config.run import DhtConfig, ModelConfig, TransportConfig
from agora_core.errors import ConfigError
from agora_core.wire.dtypes import TaggedArray
from agora_devkit.worker import train_one_pass
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend
from agora_worker.serving.tensors import activations, split_samples
from agora_worker.settings import WorkerSettings

DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
MODEL = ModelConfig(
    d_model=64, n_heads=2, mlp_ratio=2.0, subspace_rank=8, vocab_size=256, seq_len=16, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="codec", seed=11, model=MODEL, dht=DHT)
FAST = WorkerSettings(
    device="cpu", max_batch_samples=8, progress_interval_s=0.05, announce_interval_s=0.2, shutdown_grace_s=5
)
BF16_RELATIVE = 2.0**-8  # round to nearest: at most half of bf16's 2^-7 spacing, relative


def bf16_autocast():
    return torch.autocast(device_type="cpu", dtype=torch.bfloat16)


def stream_and_tokens(stage, seed: int = 0):
    """A residual stream X = C U^T + PE + T[tokens] with known coefficients C (B, T, k)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.seq_len), generator=generator)
    coefficients = torch.randn(2, MODEL.seq_len, MODEL.subspace_rank, generator=generator)
    stream = coefficients @ stage.fixed.basis.T + stage.fixed.fixed_stream(tokens)
    return stream, tokens, coefficients


def test_under_bf16_autocast_the_codec_rebuilds_the_stream_exactly_in_fp32():
    stage = build_stage(RUN, 1)
    stream, tokens, coefficients = stream_and_tokens(stage)
    with bf16_autocast():
        payload = stage.fixed.encode(stream, tokens)
        rebuilt = stage.fixed.decode(payload, tokens)
    assert payload.dtype == rebuilt.dtype == torch.float32
    torch.testing.assert_close(payload, coefficients, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rebuilt, stream, rtol=1e-6, atol=1e-6)


def test_under_bf16_autocast_what_the_blocks_add_stays_in_the_subspace():
    stage = build_stage(RUN, 1)
    stream, tokens, _ = stream_and_tokens(stage, seed=1)
    with torch.no_grad(), bf16_autocast():
        out = stage.run_blocks(stream)
        trained = out.float() - stage.fixed.fixed_stream(tokens)
    basis = stage.fixed.basis
    off_subspace = trained - (trained @ basis) @ basis.T  # what a boundary would drop
    assert float(off_subspace.norm() / trained.norm()) < 1e-5  # bf16 rounding would leave ~1e-3


def test_a_bf16_boundary_on_the_wire_is_rebuilt_within_bf16_rounding():
    stage = build_stage(RUN, 1)
    stream, tokens, coefficients = stream_and_tokens(stage, seed=2)
    sent = split_samples(coefficients.to(torch.bfloat16), np.array([1]))
    assert all(isinstance(part, TaggedArray) and part.dtype == "bfloat16" for part in sent)
    received = np.concatenate(
        [activations("boundary", part, shape=(1, MODEL.seq_len, MODEL.subspace_rank)) for part in sent]
    )  # the receiving stage's input check widens the words to float32
    rebuilt = stage.fixed.decode(torch.from_numpy(received), tokens)
    error = (rebuilt - stream).norm(dim=-1)  # per token: |dC U^T| = |dC|, U orthonormal
    bound = BF16_RELATIVE * coefficients.norm(dim=-1) + 1e-5
    assert bool((error <= bound).all()) and float(error.max()) > 0


def test_a_stage_sends_its_boundary_and_input_gradient_in_the_run_s_wire_dtype():
    outputs = {}
    for dtype in (torch.float32, torch.bfloat16):
        module = build_stage(RUN, 1)
        backend = StageBackend(
            module,
            HostOptimizer(module, RUN.optimizer, clip_threshold=1.0),
            torch.device("cpu"),
            boundary_dtype=dtype,
        )
        _, tokens, coefficients = stream_and_tokens(module, seed=3)
        grad = torch.randn(coefficients.shape, generator=torch.Generator().manual_seed(4))
        outputs[dtype] = (backend.forward(tokens, coefficients), backend.backward(tokens, coefficients, grad))
    for sent, exact in zip(outputs[torch.bfloat16], outputs[torch.float32], strict=True):
        assert sent.dtype == torch.bfloat16
        assert torch.equal(sent, exact.to(torch.bfloat16))  # narrowed once, at the edge


def test_the_boundary_dtype_is_a_transport_setting_checked_on_load():
    assert TransportConfig().boundary_dtype == "fp32"
    assert parse_run_config('[transport]\nboundary_dtype = "bf16"\n').transport.boundary_dtype == "bf16"
    with pytest.raises(ConfigError, match=r"transport\.boundary_dtype"):
        parse_run_config('[transport]\nboundary_dtype = "fp16"\n')


async def test_workers_of_a_bf16_wire_run_accept_each_other_s_boundaries(workers, client):
    run = dataclasses.replace(RUN, transport=TransportConfig(boundary_dtype="bf16"))
    pipeline = [await workers(s, run=run) for s in range(3)]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab_size, (2, MODEL.seq_len), dtype=np.int64)
    labels = rng.integers(0, MODEL.vocab_size, (2, MODEL.seq_len), dtype=np.int64)
    trained = await train_one_pass(client, [w.address for w in pipeline], tokens, labels)
    for reply, name in (
        (trained.head, "boundary"),
        (trained.body, "boundary"),
        (trained.tail, "grad"),
        (trained.back, "grad"),
    ):
        assert isinstance(reply.tensors[name], TaggedArray) and reply.tensors[name].dtype == "bfloat16"
    # the fp32 pipeline's loss, within what bf16 boundaries move it
    stages = [build_stage(RUN, s) for s in range(3)]
    t = torch.from_numpy(tokens)
    with torch.no_grad():
        loss = stages[2](t, stages[1](t, stages[0](t)), torch.from_numpy(labels))
    np.testing.assert_allclose(trained.tail.tensors["loss"], loss.numpy(), rtol=1e-2)
    infos = [(await client.call(w.address, "worker.info")).meta for w in pipeline]
    assert [i["samples"] for i in infos] == [2, 2, 2]
