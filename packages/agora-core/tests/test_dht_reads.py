"""Reads ask a majority of a key's replicas and hedge around a slow one (``dht.reads``), on
real nodes on 127.0.0.1: one of them sits behind an emulated link so slow that waiting for
its answer would cost a read 0.4 s, yet it stays alive (its probes have time to spare)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest

from agora_core.config.run import DhtConfig
from agora_core.contract import Method
from agora_core.dht import DhtNode, bulk
from agora_core.dht.records import make_record
from agora_core.identity import NodeKey
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator
from agora_devkit.processes import poll_until, wait_until_async

SLOW_ONE_WAY_S = 0.2  # an answer from the slow replica takes >= 0.4 s (its link, both ways)
BOUND_S = 0.2  # a read that waited for it would take >= 0.4 s
# no anti-entropy within a test: only read repair may mend a replica
CONFIG = DhtConfig(
    gossip_period_s=1.0, probe_timeout_s=0.9, suspicion_timeout_s=30.0, op_timeout_s=5.0, sync_periods=10**6
)

pytestmark = [pytest.mark.asyncio, pytest.mark.slow]


@contextlib.asynccontextmanager
async def swarm() -> AsyncIterator[tuple[DhtNode, DhtNode, str, list[DhtNode]]]:
    """Three fast nodes and a slow one, all alive in every view; yields (reader, slow node,
    a key whose replicas are the other three, those replicas). Stops every node it started."""
    nodes: list[DhtNode] = []
    try:
        for i in range(4):
            link = LinkEmulator(LinkConfig(latency_s=SLOW_ONE_WAY_S)) if i == 3 else None
            nodes.append(
                DhtNode(key=NodeKey.generate(), config=CONFIG, link=link, bootstrap=bootstrap(nodes))
            )
            await nodes[-1].start()
        await wait_until_async(
            lambda: all(len(n.table.alive()) == 4 for n in nodes),
            timeout_s=30,
            what="every node alive in every view",
        )
        slow = nodes[3]
        # R = 3 of 4 nodes: a key leaving out one fast node, whom that node then reads from
        key, reader = next(
            (key, outsider)
            for key in (f"reads/{i}" for i in range(1000))
            for outsider in nodes[:3]
            if outsider not in (replicas := [by_id(nodes, m.node_id) for m in nodes[0].replicas(key)])
        )
        yield reader, slow, key, replicas
    finally:
        await asyncio.gather(*(n.stop(leave=False) for n in nodes), return_exceptions=True)


def bootstrap(nodes: list[DhtNode]) -> list[str]:
    return [nodes[0].address] if nodes else []


def by_id(nodes: list[DhtNode], node_id: str) -> DhtNode:
    return next(n for n in nodes if n.node_id == node_id)


async def test_a_get_answers_from_a_majority_within_a_bound_while_one_replica_is_slow():
    async with swarm() as (reader, slow, key, replicas):
        assert slow in replicas
        await reader.store(key, "s", "v", time.time() + 60)  # at every replica, the slow one too
        for _ in range(12):  # ~2 in 3 of these ask the slow replica among their first two
            assert slow.node_id in {m.node_id for m in reader.replicas(key)}  # still a replica
            started = time.monotonic()
            got = await reader.get(key)
            assert time.monotonic() - started < BOUND_S
            assert got["s"].value == "v"


async def test_a_replica_answering_after_the_read_returned_is_still_repaired():
    async with swarm() as (reader, slow, key, replicas):
        record = make_record(key, "s", "v", time.time() + 60, signer=reader.key)
        items, tensors = bulk.pack("items", [[key, "s", record.to_wire()]])
        for node in replicas:  # a write that reached the fast replicas only
            if node is not slow:
                reply = await reader.client.call(node.address, Method.DHT_STORE, items, tensors)
                assert reply.meta["stored"] == [True]

        async def read_until_repaired() -> bool:
            # each read returns from the fast replicas; the slow one, asked in ~2 of 3 reads (or
            # when the quorum is late), answers in ~0.4 s: too late for the read, not for repair
            started = time.monotonic()
            assert (await reader.get(key))["s"].value == "v"
            assert time.monotonic() - started < BOUND_S
            return "s" in slow.records.get(key, now=time.time())

        await poll_until(read_until_repaired, timeout_s=20, what="the slow replica repaired")
