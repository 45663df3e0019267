"""Injected failures on in-process workers (real sockets, a real DHT): the operator's records
fire at the worker's forward, backward and state-download points, each once, counted.

What kills a process (exit at an averaging send) is test_injection_processes.py's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agora_core.config import OperatorConfig, RunConfig, SurrogateConfig
from agora_core.config.lifecycle import JoinConfig
from agora_core.config.run import DhtConfig, ModelConfig
from agora_core.contract import Method
from agora_core.errors import BadRequest
from agora_core.identity import NodeKey
from agora_core.injection import Targets
from agora_core.injection.publish import new_injection, publish
from agora_devkit.processes import wait_until_async
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

OPERATOR = NodeKey.generate()
DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
MODEL = ModelConfig(
    kind="surrogate", d_model=32, n_heads=2, subspace_rank=4, vocab_size=256, seq_len=8, stage_layers=(1, 1)
)
RUN = RunConfig(
    name="inject-worker",
    model=MODEL,
    dht=DHT,
    operator=OperatorConfig(public_keys=[OPERATOR.public_key.hex()], injection_watch_s=0.05),
)
FAST = WorkerSettings(
    device="cpu", max_batch_samples=16, progress_interval_s=0.05, announce_interval_s=0.2, shutdown_grace_s=5
)


def obeyed(worker: Worker, record: str, action: str) -> float:
    labels = {"record": record, "action": action}
    return worker.metrics.sample_value("agora_injections_obeyed_total", labels) or 0.0


async def order(seed, *injections) -> None:
    for injection in injections:
        await publish(seed, OPERATOR, RUN.name, injection)


async def test_forward_and_backward_triggers_fire_mid_request_and_the_nan_is_refused_downstream(
    seed, workers, client
):
    head, tail = await workers(0), await workers(1)
    nan = new_injection(trigger="forward", action="nan", targets=Targets(nodes=(tail.key.node_id,)))
    slow = new_injection(
        trigger="backward", action="slow", factor=4.0, duration_s=60.0, targets=Targets(stage=0)
    )
    await order(seed, nan, slow)
    await wait_until_async(lambda: head.injections.armed and tail.injections.armed, what="both armed")
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 256, (1, 8), dtype=np.int64)
    boundary = (await client.call(head.address, Method.FORWARD, {"stage": 0}, {"tokens": tokens})).tensors
    reply = await client.call(
        tail.address,
        Method.FORWARD_BACKWARD,
        {"stage": 1},
        {"tokens": tokens, "boundary": boundary["boundary"], "labels": tokens},
    )
    grad = reply.tensors["grad"]
    assert np.isnan(grad).all() and np.isfinite(reply.tensors["loss"]).all()  # corrupted on the way out
    # the existing guard: the head's input check refuses the NaN gradient (the trainer then
    # abandons the sample); the tail's own accumulated gradients stay clean
    with pytest.raises(BadRequest, match="NaN"):
        await client.call(head.address, Method.BACKWARD, {"stage": 0}, {"tokens": tokens, "grad": grad})
    assert head.runtime.slowdown.factor == 1.0  # a refused request never reached the backward point
    clean = rng.standard_normal(grad.shape).astype(np.float32)
    await client.call(head.address, Method.BACKWARD, {"stage": 0}, {"tokens": tokens, "grad": clean})
    assert head.runtime.slowdown.factor == 4.0
    assert obeyed(tail, nan.id, "nan") == 1 and obeyed(head, slow.id, "slow") == 1
    assert obeyed(head, nan.id, "nan") == 0  # not its record
    info = (await client.call(tail.address, Method.WORKER_INFO)).meta["injections"]
    assert info["obeyed"] == [nan.id] and info["armed"] == []
    # a second forward_backward: obeyed once, so clean again
    again = await client.call(
        tail.address,
        Method.FORWARD_BACKWARD,
        {"stage": 1},
        {"tokens": tokens, "boundary": boundary["boundary"], "labels": tokens},
    )
    assert np.isfinite(again.tensors["grad"]).all()


async def test_a_download_trigger_fires_mid_download_on_the_joiner_it_names(seed, workers):
    big = dataclasses.replace(
        RUN,
        model=dataclasses.replace(MODEL, surrogate=SurrogateConfig(dummy_parameters=1 << 18)),
        join=JoinConfig(piece_bytes=64 * 1024, pieces_in_flight=1, piece_timeout_s=3.0),
    )
    await workers(0, run=big)
    joiner_key = NodeKey.generate()
    injection = new_injection(
        trigger="download",
        action="slow",
        factor=2.0,
        duration_s=30.0,
        at_chunk=3,
        targets=Targets(nodes=(joiner_key.node_id,), joiners=True),
    )
    await order(seed, injection)
    joiner = Worker(
        run=big,
        stage=0,
        key=joiner_key,
        bootstrap=[seed.address],
        settings=dataclasses.replace(FAST, download="always"),
    )
    try:
        await joiner.start()
        assert joiner.joined.source == "peers" and joiner.joined.verified
        assert list(joiner.injection_watch.obeyed) == [injection.id]
        assert joiner.runtime.slowdown.factor == 2.0 and obeyed(joiner, injection.id, "slow") == 1
    finally:
        await joiner.stop(grace_s=1)
