"""The router as witness: a tail replica whose samples' loss jumps gets no new microbatch
(logged once, counted) until its exclusion lapses, then shares the work again; a backward of a
sample forwarded before its worker was distrusted still goes to that worker, and carries the
weight version its forward's reply named.

The pipeline is in-process: a stand-in client answers every call like a head or a tail, with
the loss each tail replica is set to give, so these run no sockets and no torch.
"""

from __future__ import annotations

import collections
import random

import numpy as np
import structlog

from agora_core.contract import Method
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload
from agora_core.schema import WorkerAnnouncement
from agora_trainer.balancer import StageBalancer
from agora_trainer.routing import Counters, LaneState, PipelineRouter, RoutingConfig
from agora_trainer.spotcheck import SpotCheckConfig

K = 4  # the boundary width


def announce(node_id: str, stage: int, port: int) -> WorkerAnnouncement:
    return WorkerAnnouncement(
        node_id=node_id,
        address=f"tcp://127.0.0.1:{port}",
        stage=stage,
        phase="serving",
        throughput=10.0,
        load=0,
        max_batch=8,
        version="t",
    )


class StandInPipeline:
    """Answers calls as the workers of ``stages`` (node ids per stage; the last is the tail)."""

    def __init__(self, stages: list[list[str]], loss: dict[str, float]):
        self.loss = loss  # per tail replica: the mean loss its samples get
        self.announcements = [
            announce(node_id, stage, 20000 + 10 * stage + i)
            for stage, node_ids in enumerate(stages)
            for i, node_id in enumerate(node_ids)
        ]
        self.by_address = {a.address: a.node_id for a in self.announcements}
        self.calls: list[tuple[str, str]] = []  # (node id, method)
        self.metas: list[object] = []  # each call's meta, in call order
        self.versions: dict[str, object] = {}  # what a worker's forward reply names as its version
        self.on_tail = lambda: None  # runs while a tail call is in flight
        self._rng = random.Random(0)

    def balancers(self, stages: int) -> list[StageBalancer]:
        balancers = [StageBalancer(stage) for stage in range(stages)]
        for balancer in balancers:
            balancer.update(self.announcements)
        return balancers

    async def call(self, address, method, meta, tensors, *, timeout_s) -> Payload:
        node_id = self.by_address[address]
        self.calls.append((node_id, method))
        self.metas.append(meta)
        tokens = tensors["tokens"]  # (B, T)
        if method == Method.FORWARD:
            named = {"version": self.versions[node_id]} if node_id in self.versions else None
            return Payload(meta=named, tensors={"boundary": np.zeros((*tokens.shape, K), np.float32)})
        if method == Method.FORWARD_BACKWARD:
            self.on_tail()
            mean = self.loss[node_id]
            loss = [max(0.1, self._rng.gauss(mean, 0.1 * mean)) for _ in range(tokens.shape[0])]
            return Payload(
                tensors={"loss": np.array(loss, np.float32), "grad": np.ones((*tokens.shape, K), np.float32)}
            )
        return Payload()

    def served(self, method: str, since: int = 0) -> collections.Counter[str]:
        return collections.Counter(node_id for node_id, m in self.calls[since:] if m == method)


def make_router(
    pipeline: StandInPipeline, balancers: list[StageBalancer], **config
) -> tuple[PipelineRouter, NodeMetrics]:
    metrics = NodeMetrics(role="trainer", instance="t")
    config = {"spot_check": SpotCheckConfig(fraction=0.0), **config}  # calls are counted here
    return PipelineRouter(pipeline, balancers, RoutingConfig(**config), Counters(), metrics), metrics


async def run_microbatches(router: PipelineRouter, count: int) -> None:
    tokens = np.zeros((2, 9), np.int64)  # (B, seq_len + 1)
    for _ in range(count):
        await router.run(tokens, LaneState())


async def test_a_tail_replica_whose_loss_jumps_gets_no_work_until_its_exclusion_lapses(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("agora_core.world.monotonic", lambda: now[0])  # the world's clock seam
    pipeline = StandInPipeline(
        [["h0", "h1"], ["t0", "t1", "wrecked"]], {"t0": 3.8, "t1": 3.8, "wrecked": 38.0}
    )
    router, metrics = make_router(pipeline, pipeline.balancers(2), distrust_s=60.0)
    with structlog.testing.capture_logs() as logs:
        for _ in range(100):  # until it is judged (a few dozen of its samples at most)
            await run_microbatches(router, 1)
            if router.counters.outliers:
                break
    (event,) = [e for e in logs if e["event"] == "worker_loss_outlier"]
    assert event["stage"] == 1 and event["node"] == "wrecked" and event["log_level"] == "warning"
    assert event["mean_loss"] > 30 and event["others_mean_loss"] < 5
    assert event["samples"] >= 16 and event["others_samples"] >= 16
    assert metrics.sample_value("agora_trainer_loss_outliers_total", {"to_stage": "1"}) == 1
    assert metrics.sample_value("agora_trainer_loss_outliers_total", {"to_stage": "0"}) == 0
    assert router.counters.outliers == 1

    since = len(pipeline.calls)
    now[0] += 59.0
    await run_microbatches(router, 60)
    assert pipeline.served(Method.FORWARD_BACKWARD, since)["wrecked"] == 0
    assert router.counters.outliers == 1  # no new verdict: the head replicas are not blamed

    pipeline.loss["wrecked"] = 3.8  # repaired meanwhile
    now[0] += 2.0
    since = len(pipeline.calls)
    await run_microbatches(router, 60)
    served = pipeline.served(Method.FORWARD_BACKWARD, since)
    assert 10 <= served["wrecked"] <= 30, served  # back, level with the others: not flooded
    assert router.counters.outliers == 1  # judged afresh on its new samples: sound


async def test_a_backward_goes_to_its_forward_worker_even_if_distrusted_meanwhile_and_is_no_evidence():
    pipeline = StandInPipeline([["h0", "h1"], ["t0"]], {"t0": 3.8})
    balancers = pipeline.balancers(2)
    router, _ = make_router(pipeline, balancers)

    def distrust_its_head() -> None:  # a verdict lands while the first microbatch is at the tail
        if len(pipeline.calls) == 2:  # its forward, then this call
            balancers[0].distrust(pipeline.calls[0][0], 60.0)

    pipeline.on_tail = distrust_its_head
    await run_microbatches(router, 1)
    forward, backward = pipeline.calls[0], pipeline.calls[2]
    assert backward == (forward[0], Method.BACKWARD) and router.counters.fallbacks == 0
    assert router.witness.samples(1, "t0") == 0  # its losses were not recorded
    await run_microbatches(router, 1)
    assert router.witness.samples(1, "t0") == 2


async def test_a_backward_carries_the_weight_version_its_forward_named_and_only_an_int():
    pipeline = StandInPipeline([["h0"], ["b0"], ["t0"]], {"t0": 3.8})
    router, _ = make_router(pipeline, pipeline.balancers(3))
    pipeline.versions = {"h0": 7 << 32 | 3, "b0": "not a version"}  # the body's word is no int
    await run_microbatches(router, 1)
    backwards = {
        node_id: meta
        for (node_id, method), meta in zip(pipeline.calls, pipeline.metas, strict=True)
        if method == Method.BACKWARD
    }
    assert backwards == {"b0": {"stage": 1}, "h0": {"stage": 0, "version": 7 << 32 | 3}}
