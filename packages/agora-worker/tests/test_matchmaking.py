"""Matchmaking decides who is in a round's group by who wrote each entry and what that node's
credential says, not by what the entry says: real DHT nodes of an authorized run on 127.0.0.1."""

from __future__ import annotations

import contextlib
from dataclasses import asdict

import pytest

from agora_core.config.run import DhtConfig
from agora_core.contract import Phase
from agora_core.dht import DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.schema import averaging_round_key
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import wait_until_async
from agora_worker.averaging.matchmaking import Matchmaker, Peer

RUN = "matchmaking"
STAGE = 1
CONFIG = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
pytestmark = pytest.mark.timeout(60)


def entry_of(node: DhtNode, *, weight: float = 1.0, reducer: bool = True, node_id: str | None = None) -> dict:
    peer = Peer(
        node_id=node_id or node.node_id,
        address=node.address,
        weight=weight,
        reducer=reducer,
        phase=Phase.SERVING,
    )
    return asdict(peer)


@contextlib.asynccontextmanager
async def authorized_nodes(*credentials: tuple[str, int | None]):
    """One DHT node per (role, stage) credential, joined into one membership view."""
    authority = TestAuthority(RUN)
    nodes: list[DhtNode] = []
    try:
        for role, stage in credentials:
            key = NodeKey.generate()
            held = authority.credential(key, role=role, stage=stage).to_value()
            node = DhtNode(
                key=key,
                config=CONFIG,
                bootstrap=[nodes[0].address] if nodes else [],
                verifier=authority.security(key, None).verifier,
                credential=lambda held=held: held,
            )
            nodes.append(node)
            await node.start()
        ids = {n.node_id for n in nodes}
        await wait_until_async(lambda: all(n.live_ids() == ids for n in nodes), what="one view", timeout_s=15)
        yield nodes
    finally:
        for node in nodes:
            with contextlib.suppress(Exception):
                await node.stop(leave=False)


async def test_only_workers_credentialed_for_the_stage_writing_as_themselves_join_and_config_says_who_reduces():
    async with authorized_nodes(
        ("worker", STAGE),
        ("worker", STAGE),
        ("worker", STAGE),
        ("worker", STAGE),
        ("worker", 0),
        ("trainer", None),
    ) as nodes:
        me, honest, listed, forger, other_stage, trainer = nodes
        key = averaging_round_key(RUN, STAGE, 0)
        # the honest peer declares it may not reduce; the listed one declares nothing true either
        await OwnedEntry(honest, honest.key, key).publish(entry_of(honest, reducer=False), 60)
        await OwnedEntry(listed, listed.key, key).publish(entry_of(listed, reducer=False), 60)
        await OwnedEntry(other_stage, other_stage.key, key).publish(entry_of(other_stage), 60)
        await OwnedEntry(trainer, trainer.key, key).publish(entry_of(trainer), 60)
        # a worker of the stage writes an entry naming the honest peer, at its own address
        await OwnedEntry(forger, forger.key, key).publish(entry_of(forger, node_id=honest.node_id), 60)

        reducers = {me.node_id, listed.node_id}
        matchmaker = Matchmaker(
            dht=me,
            key=me.key,
            run_name=RUN,
            stage=STAGE,
            ttl_s=60,
            reduces=lambda node_id: node_id in reducers,
        )
        mine = Peer(node_id=me.node_id, address=me.address, weight=1.0, reducer=False, phase=Phase.SERVING)
        expected = {me.node_id, honest.node_id, listed.node_id}
        group = await matchmaker.form_group(0, mine, expected=expected, window_s=3.0)
        assert [m.node_id for m in group.members] == sorted(expected)
        assert {m.node_id for m in group.reducers} == reducers  # the run config's, not the entries'
        refused: dict[str, str] = {}
        matchmaker.peers(await me.get(key), refused)
        assert "stage 0, not this stage" in refused[other_stage.node_id]
        assert "a trainer's" in refused[trainer.node_id]
        assert "names another node" in refused[honest.node_id]  # the forged entry; the real one counts
        assert next(m for m in group.members if m.node_id == honest.node_id).address == honest.address
        assert next(m for m in group.members if m.node_id == honest.node_id).address == honest.address
