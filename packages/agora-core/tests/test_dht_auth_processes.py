"""The DHT of an authorized run against forged membership, with real node processes: the
member tables checked are those of ``agora dht serve`` processes, read over the RPC.

A credentialed insider (a member gone bad) sends forged DEAD and LEFT reports and ALIVE
claims about a live member, with a huge incarnation, and floods made-up members through
join, sync and ping. Every made-up address is loopback.
"""

from __future__ import annotations

import contextlib
import random

from agora_core.contract import Method
from agora_core.dht import DhtNode, Status, member_list
from agora_core.dht.claims import Claims
from agora_core.dht.membership import Member
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import poll_until

HUGE = 1 << 62


def signed_claim(
    authority: TestAuthority, key: NodeKey, incarnation: int, status: Status, held: dict | None, *, port: int
) -> list:
    """``key``'s claim at a loopback address, signed by ``key``."""
    member = Member(key.node_id, f"tcp://127.0.0.1:{port}", key.public_key, incarnation, status)
    Claims(key=key, verifier=authority.security(key, None).verifier, credential=lambda: held).sign(member)
    return member.to_wire()


async def members(client: RpcClient, address: str) -> dict[str, list]:
    reply = await client.call(address, Method.DHT_MEMBERS, {}, timeout_s=5)
    return {m[0]: m for m in member_list.unpack(reply.meta, reply.tensors)}


async def test_forged_reports_and_a_flood_of_fake_members_change_no_process_table(authority, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        authority.seed_process(tmp_path / "a") as seed,
        authority.seed_process(tmp_path / "b", seed.bootstrap) as victim,
    ):
        mallory = NodeKey.generate()  # credentialed: an insider, a real member of the DHT
        held = authority.credential(mallory)
        insider = authority.security(mallory, held)
        insider.expect(seed.address, seed.key.public_key)
        node = DhtNode(
            key=mallory, config=authority.run_config().dht, bootstrap=[seed.address], security=insider
        )
        await node.start()
        client = node.client
        try:
            me = node.table.me.to_wire()

            async def settled() -> bool:  # both processes see the other and the insider
                views = [await members(client, a) for a in (seed.address, victim.address)]
                return all(len(v) == 3 for v in views)

            await poll_until(settled, timeout_s=20, what="three members in both views")
            before = await members(client, seed.address)
            real = before[victim.key.node_id]
            stolen = real[6]  # the victim's credential: its claims carry it
            dead = [*real[:3], HUGE, int(Status.DEAD), None, None]
            left = signed_claim(
                authority, mallory, HUGE, Status.LEFT, stolen, port=1
            )  # signed by the wrong key
            left[:3] = real[:3]
            alive = signed_claim(authority, mallory, HUGE, Status.ALIVE, stolen, port=2)
            alive[:3] = [real[0], "tcp://127.0.0.1:2", real[2]]
            forged = [dead, left, alive]
            rng = random.Random(3)
            fakes = []
            for i in range(10_000):
                key = NodeKey.generate()
                held_by_fake = None if i % 2 else authority.credential(key, run="another-run").to_value()
                fakes.append(
                    signed_claim(authority, key, 1, Status.ALIVE, held_by_fake, port=rng.randint(1024, 65535))
                )
            for start in range(0, len(fakes), 100):  # a header holds at most 64 KiB
                batch = fakes[start : start + 100]
                await client.call(seed.address, Method.DHT_SYNC, {"members": forged + batch}, timeout_s=10)
                await client.call(
                    seed.address, Method.DHT_PING, {"from": me, "updates": forged + batch}, timeout_s=10
                )
            for fake in fakes[:50]:
                with contextlib.suppress(Exception):  # refused: a join with no valid claim
                    await client.call(seed.address, Method.DHT_JOIN, {"member": fake}, timeout_s=5)
            for address in (seed.address, victim.address):
                after = await members(client, address)
                assert set(after) == set(before), "the table changed"
                seen = after[victim.key.node_id]
                assert seen[3] < HUGE and seen[4] == int(Status.ALIVE) and seen[1] == victim.address
            # and the seed still reaches it where its own claim says: it answers the seed's ping
            probe = {"from": me, "updates": [], "target": real}
            reply = await client.call(seed.address, Method.DHT_PING_REQ, probe, timeout_s=5)
            assert reply.meta["ok"] is True
            assert (await members(client, seed.address))[victim.key.node_id][4] == int(Status.ALIVE)
        finally:
            await node.stop()
