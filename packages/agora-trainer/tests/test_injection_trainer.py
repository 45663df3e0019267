"""Injected failures on a trainer (in-process, real sockets and DHT): its hops are trigger
points, and a NaN it is told to send is refused by the worker and costs one sample, counted.

The two stages are plain RPC servers on 127.0.0.1 that answer like a head and a tail (and
refuse a non-finite gradient, as a worker's input check does: ``agora_trainer.testing``), so
no torch is imported here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agora_core.config import OperatorConfig, RunConfig
from agora_core.config.run import DhtConfig, ModelConfig
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.injection import Targets
from agora_core.injection.publish import new_injection, publish
from agora_core.testing import wait_until_async
from agora_trainer.sharding import make_shards
from agora_trainer.testing import StandInStage
from agora_trainer.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

OPERATOR = NodeKey.generate()
K = 4  # the boundary width
RUN = RunConfig(
    name="inject-trainer",
    model=ModelConfig(
        kind="surrogate",
        d_model=32,
        n_heads=2,
        subspace_rank=K,
        vocab_size=256,
        seq_len=8,
        stage_layers=(1, 1),
    ),
    dht=DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0),
    operator=OperatorConfig(public_keys=[OPERATOR.public_key.hex()], injection_watch_s=0.05),
)


async def test_a_trainer_obeys_its_records_at_its_hops_and_a_nan_it_sends_costs_one_sample(tmp_path):
    # a few hundred samples from this file: the standard library's sources take seconds to scan
    make_shards(tmp_path / "shards", shards=1, tokenizer=ByteTokenizer(), sources=[Path(__file__)])
    seed = DhtNode(key=NodeKey.generate(), config=RUN.dht)
    await seed.start()
    stages = [StandInStage(0, K), StandInStage(1, K)]
    for stage in stages:
        await stage.server.start()
        await stage.announce(seed, RUN.name)
    trainer = Trainer(
        run=RUN,
        shards_dir=tmp_path / "shards",
        key=NodeKey.generate(),
        bootstrap=[seed.address],
        settings=TrainerSettings(lanes=1, max_samples=6, refresh_interval_s=0.2, progress_interval_s=0.5),
    )
    try:
        await trainer.start()
        nan = new_injection(trigger="backward", action="nan", targets=Targets(role="trainer"))
        slow = new_injection(trigger="forward", action="slow", factor=1.5, duration_s=60.0)
        workers_only = new_injection(trigger="now", action="nan", targets=Targets(role="worker"))
        for injection in (nan, slow, workers_only):
            await publish(seed, OPERATOR, RUN.name, injection)
        await wait_until_async(lambda: len(trainer.injections.waiting()) == 2, what="both records armed")
        counters = await trainer.train()
        # the one sample whose gradient was NaN is abandoned (counted, logged); max_samples still complete
        assert trainer.abandoned == 1 and counters.completed == 6 and counters.dispatched == 7
        assert sum(not np.isfinite(g).all() for g in stages[0].grads) == 1
        assert trainer.router.slowdown.factor == 1.5
        assert set(trainer.injection_watch.obeyed) == {nan.id, slow.id}  # not the workers' record
        for injection in (nan, slow):
            labels = {"record": injection.id, "action": str(injection.action)}
            assert trainer.metrics.sample_value("agora_injections_obeyed_total", labels) == 1
    finally:
        await trainer.close()
        for stage in stages:
            await stage.server.stop()
        await seed.stop()
