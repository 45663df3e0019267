"""The DHT in an authorized run: membership and records an attacker cannot bend.

Real DhtNodes on 127.0.0.1 in this process, each with a credential a test authorizer issued.
The attacker is an RpcClient speaking the DHT's methods directly: forged reports and claims,
floods of made-up members, ids ground next to a key, records under forged or missing
signatures. Every made-up address is loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator

import msgpack
import pytest

from agora_core.admission.revocations import Revocations
from agora_core.auth.peers import PeerVerifier
from agora_core.config.run import DhtConfig
from agora_core.dht import DhtNode, Status
from agora_core.dht import claims as claims_module
from agora_core.dht.claims import Claims
from agora_core.dht.gossip import MAX_CHECKS_PER_REQUEST
from agora_core.dht.ids import key_id, node_position
from agora_core.dht.membership import Member
from agora_core.dht.records import Record, make_record
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import wait_until_async

RUN = "auth-test"
PERIOD_S = 0.2
CONFIG = DhtConfig(
    gossip_period_s=PERIOD_S,
    probe_timeout_s=0.1,
    suspicion_timeout_s=2.0,
    op_timeout_s=2.0,
    join_timeout_s=5.0,
    sync_periods=5,
    tombstone_s=30.0,
)
AUTHORIZER = NodeKey.generate()
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def credential_for(key: NodeKey, *, lifetime_s: float = 600.0, run: str = RUN, authorizer=AUTHORIZER) -> dict:
    signed = TestAuthority(RUN, authorizer).credential(
        key, run=run, lifetime_s=lifetime_s, role="dht", stage=None
    )
    return signed.to_value()


def verifier() -> PeerVerifier:
    return PeerVerifier(run=RUN, authorizer_key=AUTHORIZER.public_key, max_clock_skew_s=0.0)


class Swarm:
    def __init__(self) -> None:
        self.nodes: list[DhtNode] = []
        self.credentials: dict[str, dict] = {}  # node id -> the credential its node presents

    async def add(self, key: NodeKey | None = None, *, lifetime_s: float = 600.0) -> DhtNode:
        key = key or NodeKey.generate()
        self.credentials[key.node_id] = credential_for(key, lifetime_s=lifetime_s)
        node = DhtNode(
            key=key,
            config=CONFIG,
            bootstrap=[self.nodes[0].address] if self.nodes else [],
            verifier=verifier(),
            credential=lambda: self.credentials[key.node_id],
        )
        self.nodes.append(node)
        await node.start()
        return node

    def agree(self) -> bool:
        expected = {n.node_id for n in self.nodes}
        return all(n.live_ids() == expected for n in self.nodes)


@contextlib.asynccontextmanager
async def swarm_of(count: int, **kwargs) -> AsyncIterator[Swarm]:
    swarm = Swarm()
    try:
        for _ in range(count):
            await swarm.add(**kwargs)
        await wait_until_async(swarm.agree, timeout_s=15, what="one membership view")
        yield swarm
    finally:
        for node in swarm.nodes:
            with contextlib.suppress(Exception):
                await node.stop(leave=False)


@contextlib.asynccontextmanager
async def attacker_client() -> AsyncIterator[RpcClient]:
    client = RpcClient()
    try:
        yield client
    finally:
        await client.close()


def claim(
    key: NodeKey, incarnation: int, status: Status = Status.ALIVE, *, credential=None, port: int = 1
) -> list:
    """``key``'s own claim for this run, signed, at a loopback address."""
    member = Member(key.node_id, f"tcp://127.0.0.1:{port}", key.public_key, incarnation, status)
    Claims(key=key, verifier=verifier(), credential=lambda: credential).sign(member)
    return member.to_wire()


async def still(predicate, *, periods: int = 6) -> None:
    """Assert that ``predicate`` holds at every look for ``periods`` gossip periods (an
    invariant over a window, not a wait)."""
    deadline = time.monotonic() + periods * PERIOD_S
    while time.monotonic() < deadline:
        assert predicate()
        await asyncio.sleep(PERIOD_S / 4)
    assert predicate()


async def test_forged_reports_and_claims_neither_evict_nor_raise_a_live_member():
    async with swarm_of(4) as swarm, attacker_client() as client:
        target, victim = swarm.nodes[0], swarm.nodes[1]
        incarnation = victim.table.me.incarnation
        mallory = NodeKey.generate()  # credentialed: a member gone bad
        me = claim(mallory, 1, credential=credential_for(mallory))
        huge = 1 << 62
        dead = [victim.node_id, victim.address, victim.key.public_key, huge, int(Status.DEAD), None, None]
        stolen = victim.table.me.credential  # the victim's own credential: gossip carries it
        forged_left = claim(mallory, huge, Status.LEFT, credential=stolen)
        forged_left[:3] = [victim.node_id, victim.address, victim.key.public_key]  # signed by mallory
        forged_alive = claim(mallory, huge, credential=stolen)
        forged_alive[:3] = [victim.node_id, "tcp://127.0.0.1:9", victim.key.public_key]
        suspect_now = [*victim.table.me.to_wire()[:4], int(Status.SUSPECT), None, None]  # at its incarnation
        probes = target.gossip.detector.probes
        for node in swarm.nodes:
            updates = [dead, forged_left, forged_alive, suspect_now]
            await client.call(node.address, "dht.ping", {"from": me, "updates": updates}, timeout_s=2)
            await client.call(node.address, "dht.sync", {"members": updates}, timeout_s=2)
        await wait_until_async(
            lambda: target.gossip.detector.probes > probes, timeout_s=5, what="the report to be probed"
        )

        def untouched() -> bool:
            for node in swarm.nodes[:1] + swarm.nodes[2:]:
                seen = node.table.get(victim.node_id)
                if seen.status != Status.ALIVE or seen.incarnation >= huge or seen.address != victim.address:
                    return False
            return victim.table.me.incarnation <= incarnation + 1  # at most one refutation

        await still(untouched)
        assert all(victim.node_id in n.live_ids() for n in swarm.nodes)


async def test_ten_thousand_uncredentialed_members_leave_every_table_unchanged(monkeypatch):
    async with swarm_of(3) as swarm, attacker_client() as client:

        def tables() -> list:  # who each node knows, and in what state (refutations aside)
            return [({(m.node_id, m.status) for m in n.table.known()}, n.live_ids()) for n in swarm.nodes]

        before = tables()
        rogue_authorizer = NodeKey.generate()
        rng = random.Random(7)
        fakes = []
        for i in range(10_000):
            key = NodeKey.generate()
            credential = (
                None,
                credential_for(key, authorizer=rogue_authorizer),  # forged
                credential_for(key, run="another-run"),
                {"body": b"x" * 100, "signature": bytes(64)},  # garbage
            )[i % 4]
            if i % 4 == 0 or i % 4 == 3:
                update = [key.node_id, f"tcp://127.0.0.1:{rng.randint(1024, 65535)}", key.public_key, 1, 0]
                fakes.append([*update, rng.randbytes(64), credential])  # cheap to make
            else:
                fakes.append(claim(key, 1, credential=credential, port=rng.randint(1024, 65535)))
        checks = 0
        real_verify = claims_module.verify_signature

        def counting_verify(*args):
            nonlocal checks
            checks += 1
            return real_verify(*args)

        monkeypatch.setattr(claims_module, "verify_signature", counting_verify)
        messages = 0
        for node in swarm.nodes:
            for start in range(0, len(fakes), 100):  # 100 a message: a header holds at most 64 KiB
                batch = fakes[start : start + 100]
                await client.call(node.address, "dht.sync", {"members": batch}, timeout_s=5)
                await client.call(node.address, "dht.ping", {"from": batch[1], "updates": batch}, timeout_s=5)
                messages += 2
            for fake in fakes[:100]:
                with contextlib.suppress(Exception):
                    await client.call(node.address, "dht.join", {"member": fake}, timeout_s=2)
                messages += 1
        assert checks <= messages * MAX_CHECKS_PER_REQUEST  # work per message is bounded
        assert tables() == before
        assert all(len(n.table.known()) == 3 for n in swarm.nodes)


async def test_ids_ground_next_to_a_key_never_become_its_replicas():
    async with swarm_of(3) as swarm, attacker_client() as client:
        key = "stage/0/workers"
        target = key_id(key)
        nearest = min(node_position(n.node_id) ^ target for n in swarm.nodes)
        ground = []
        for _ in range(20_000):  # each try beats 3 random ids with probability 1/4
            candidate = NodeKey.generate()
            if node_position(candidate.node_id) ^ target < nearest:
                ground.append(candidate)
                if len(ground) == 5:
                    break
        assert len(ground) == 5
        updates = [claim(k, 1, port=20_000 + i) for i, k in enumerate(ground)]
        for node in swarm.nodes:
            await client.call(node.address, "dht.ping", {"from": updates[0], "updates": updates}, timeout_s=2)
            for update in updates:
                with contextlib.suppress(Exception):
                    await client.call(node.address, "dht.join", {"member": update}, timeout_s=2)
        real = {n.node_id for n in swarm.nodes}
        for node in swarm.nodes:
            assert {m.node_id for m in node.replicas(key)} == real
        assert await swarm.nodes[0].store(key, "v", 1, time.time() + 60) == 3


async def test_expired_and_revoked_members_leave_the_view_and_a_refreshed_one_stays():
    async with swarm_of(3) as swarm:
        expiring = await swarm.add(lifetime_s=3.0)
        refreshed = await swarm.add(lifetime_s=3.0)
        revoked = await swarm.add()
        await wait_until_async(swarm.agree, timeout_s=10, what="six members everywhere")
        swarm.credentials[refreshed.node_id] = credential_for(refreshed.key)
        refreshed.credential_changed()
        others = [n for n in swarm.nodes if n not in (expiring, revoked)]
        banned = Revocations(nodes=(revoked.node_id,), updated=time.time())
        for node in others:
            node.verifier.observe(banned)

        def dropped() -> bool:
            return all(
                expiring.node_id not in n.live_ids() and revoked.node_id not in n.live_ids() for n in others
            )

        await wait_until_async(dropped, timeout_s=10, what="the expired and revoked members to be dropped")
        assert all(refreshed.node_id in n.live_ids() for n in others)
        await still(lambda: all(refreshed.node_id in n.live_ids() for n in others), periods=3)
        assert all(n.key_for_address(revoked.address) is None for n in others)


async def test_records_name_their_writer_and_replicas_refuse_forged_or_uncredentialed_ones():
    async with swarm_of(3) as swarm, attacker_client() as client:
        newcomer_key = NodeKey.generate()
        positions = [node_position(n.node_id) for n in swarm.nodes]
        # a key whose replicas, once the newcomer joins, include it
        key = next(
            f"owned/{i}"
            for i in range(10_000)
            if sum(
                (p ^ key_id(f"owned/{i}")) < (node_position(newcomer_key.node_id) ^ key_id(f"owned/{i}"))
                for p in positions
            )
            < CONFIG.replication
        )
        writer = swarm.nodes[0]
        assert await writer.store(key, "v", {"x": 1}, time.time() + 60) >= 1
        value = (await swarm.nodes[1].get(key))["v"]
        assert value.value == {"x": 1} and value.writer == writer.key.public_key

        newcomer = await swarm.add(newcomer_key)
        await wait_until_async(swarm.agree, timeout_s=10, what="the newcomer in every view")
        await wait_until_async(
            lambda: "v" in newcomer.records.get(key, now=time.time()), timeout_s=10, what="the handoff"
        )
        assert newcomer.records.get(key, now=time.time())["v"].writer == writer.key.public_key

        stranger = NodeKey.generate()  # holds no credential, is no member
        genuine = make_record(key, "v", {"x": 2}, time.time() + 120, signer=writer.key)
        evil = msgpack.packb({"x": "evil"})
        attacks = [
            [key, "v", [evil, genuine.expiration, genuine.signature, writer.key.public_key]],  # forged
            [key, "v", make_record(key, "v", {"x": "evil"}, time.time() + 120, signer=stranger).to_wire()],
            [key, "v", Record(evil, time.time() + 120).to_wire()],  # unsigned
        ]
        for replica in newcomer.replicas(key):
            reply = await client.call(
                replica.address, "dht.store", {"items": attacks, "now": time.time()}, timeout_s=2
            )
            assert reply.meta["stored"] == [False] * len(attacks)
            assert all(reply.meta["errors"]), reply.meta["errors"]
        value = (await newcomer.get(key))["v"]
        assert value.value == {"x": 1} and value.writer == writer.key.public_key


async def test_a_joiner_gets_a_member_list_larger_than_a_header_in_one_join():
    async with swarm_of(1) as swarm:
        keys = [NodeKey.generate() for _ in range(300)]  # 300 credentialed claims: ~130 KiB
        listed = [claim(k, 1, credential=credential_for(k), port=30_000 + i) for i, k in enumerate(keys)]
        first = swarm.nodes[0]
        assert first.table.apply_all(listed, limit=len(listed)) == len(listed)
        assert len(msgpack.packb(first.table.snapshot())) > 64 * 1024
        joiner = DhtNode(
            key=(key := NodeKey.generate()),
            config=CONFIG,
            bootstrap=[first.address],
            verifier=verifier(),
            credential=lambda: credential_for(key),
        )
        try:
            await joiner.start()  # its table holds what the join's reply carried, before any sync
            assert {k.node_id for k in keys} <= {m.node_id for m in joiner.table.known()}
        finally:
            await joiner.stop(leave=False)
