"""A DHT node counts its operations by kind and outcome, and times them, in its metrics
registry: what an operator's dashboard reads. Two real nodes on 127.0.0.1."""

from __future__ import annotations

import time

import pytest

from agora_core.config.run import DhtConfig
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_devkit.processes import wait_until_async

CONFIG = DhtConfig(gossip_period_s=0.3, probe_timeout_s=0.2, suspicion_timeout_s=5.0, op_timeout_s=2.0)

pytestmark = pytest.mark.asyncio


async def test_gets_and_stores_are_counted_and_timed_by_kind_and_outcome():
    first = DhtNode(key=NodeKey.generate(), config=CONFIG)
    await first.start()
    second = DhtNode(key=NodeKey.generate(), config=CONFIG, bootstrap=[first.address])
    try:
        await second.start()
        await wait_until_async(
            lambda: len(first.table.alive()) == 2 and len(second.table.alive()) == 2,
            timeout_s=20,
            what="both nodes in both views",
        )
        expiration = time.time() + 60
        for i in range(3):
            await second.store("metrics/key", f"s{i}", i, expiration)
        for _ in range(5):
            assert len(await second.get("metrics/key")) == 3
        await second.get_many(["metrics/key", "metrics/other"])

        counted = second.metrics.sample_value
        assert counted("agora_dht_ops_total", {"op": "store", "outcome": "ok"}) == 3
        assert counted("agora_dht_ops_total", {"op": "get", "outcome": "ok"}) == 5
        assert counted("agora_dht_ops_total", {"op": "get_many", "outcome": "ok"}) == 1
        assert counted("agora_dht_op_seconds_count", {"op": "get"}) == 5
        assert counted("agora_dht_op_seconds_count", {"op": "store"}) == 3
        assert counted("agora_dht_op_seconds_sum", {"op": "get"}) > 0
        # each node counts its own operations: the first made none
        assert first.metrics.sample_value("agora_dht_ops_total", {"op": "get", "outcome": "ok"}) is None
    finally:
        await second.stop(leave=False)
        await first.stop(leave=False)
