"""Injected failures on a trainer (in-process, real sockets and DHT): its hops are trigger
points, a NaN it is told to send is refused by the worker and costs one sample, counted, and
a trainer whose own link dropped resumes as soon as the link is back, not when its bans lapse.

The two stages are plain RPC servers on 127.0.0.1 that answer like a head and a tail (and
refuse a non-finite gradient, as a worker's input check does: ``agora_devkit.trainer``), so
no torch is imported here.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from agora_core.config import OperatorConfig, RunConfig
from agora_core.config.run import TransportConfig
from agora_core.identity import NodeKey
from agora_core.injection import Targets
from agora_core.injection.publish import new_injection, publish
from agora_devkit.processes import wait_until_async
from agora_devkit.trainer import StandInSwarm, stand_in_run
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer

OPERATOR = NodeKey.generate()
K = 4  # the boundary width
RUN = stand_in_run(
    "inject-trainer",
    K,
    operator=OperatorConfig(public_keys=[OPERATOR.public_key.hex()], injection_watch_s=0.05),
)


async def test_a_trainer_obeys_its_records_at_its_hops_and_a_nan_it_sends_costs_one_sample(tmp_path):
    # a few hundred samples from this file: the standard library's sources take seconds to scan
    make_shards(tmp_path / "shards", shards=1, tokenizer=ByteTokenizer(), sources=[Path(__file__)])
    async with StandInSwarm(RUN, K) as swarm:
        trainer = swarm.trainer(tmp_path / "shards", lanes=1, max_samples=6, refresh_interval_s=0.2)
        await trainer.start()
        nan = new_injection(trigger="backward", action="nan", targets=Targets(role="trainer"))
        slow = new_injection(trigger="forward", action="slow", factor=1.5, duration_s=60.0)
        workers_only = new_injection(trigger="now", action="nan", targets=Targets(role="worker"))
        for injection in (nan, slow, workers_only):
            await publish(swarm.seed, OPERATOR, RUN.name, injection)
        await wait_until_async(lambda: len(trainer.injections.waiting()) == 2, what="both records armed")
        counters = await trainer.train()
        # the one sample whose gradient was NaN is abandoned (counted, logged); max_samples still complete
        assert trainer.abandoned == 1 and counters.completed == 6 and counters.dispatched == 7
        assert sum(not np.isfinite(g).all() for g in swarm.stages[0].grads) == 1
        assert trainer.router.slowdown.factor == 1.5
        assert set(trainer.injection_watch.obeyed) == {nan.id, slow.id}  # not the workers' record
        for injection in (nan, slow):
            labels = {"record": injection.id, "action": str(injection.action)}
            assert trainer.metrics.sample_value("agora_injections_obeyed_total", labels) == 1


async def test_a_trainer_whose_link_dropped_probes_its_banned_workers_and_resumes_when_it_returns(tmp_path):
    run = RunConfig(**{**vars(RUN), "transport": TransportConfig(request_timeout_s=1.0)})
    # enough samples to outlast the test: this package's sources
    sources = sorted(Path(__file__).parents[1].glob("src/agora_trainer/*.py"))
    make_shards(tmp_path / "shards", shards=1, tokenizer=ByteTokenizer(), sources=sources)
    async with StandInSwarm(run, K) as swarm:
        trainer = swarm.trainer(tmp_path / "shards", ban_s=600.0, refresh_interval_s=0.2)
        await trainer.start()
        training = asyncio.create_task(trainer.train())
        try:
            await wait_until_async(lambda: trainer.counters.completed >= 10, what="training under way")
            trainer.node.drop_link(2.0)  # what an injected drop_link does: nothing in or out
            back = time.monotonic() + 2.0
            bans = lambda: sum(b.bans for b in trainer.balancers)  # noqa: E731
            await wait_until_async(lambda: bans() >= 2, timeout_s=10, what="the dropped link's failures")
            await wait_until_async(lambda: time.monotonic() > back, what="the link's return")
            resumed_from = trainer.counters.completed
            # every worker is banned for 10 minutes; a probe a second finds them answering again
            await wait_until_async(
                lambda: trainer.counters.completed >= resumed_from + 10, timeout_s=30, what="training resumed"
            )
            assert trainer.abandoned == 0 and not training.done()
            assert not any(b.banned(node_id) for b in trainer.balancers for node_id in b.stats())
        finally:
            trainer.request_stop()
            await asyncio.wait_for(training, timeout=30)
