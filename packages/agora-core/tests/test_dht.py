"""The DHT as a swarm: in-process nodes and nodes in their own OS processes, on 127.0.0.1.

Read-only tests share one swarm of 32 nodes in this process and 6 processes, formed and
converged before any test sees it: reads and writes from anywhere, watches, owned subkeys,
expiry and deletes, a node that stalls and comes back. Tests that kill nodes or add them start
a swarm of their own: a quarter of the nodes dies at once, newcomers take over their share of
the keys, a crashed node comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest
import pytest_asyncio

from agora_core.config import load_run_config
from agora_core.dht import DhtNode, RecordRejected, Status, bulk, member_list, owned_subkey
from agora_core.dht.records import make_record
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_devkit.processes import ChildProcess, poll_until, spawn_python, wait_until_async

IN_PROCESS = 32
PROCESSES = 6
PERIOD_S = 0.3
FAST_DHT = f"""
[dht]
gossip_period_s = {PERIOD_S}
probe_timeout_s = 0.15
suspicion_timeout_s = 4.0
op_timeout_s = 2.0
sync_periods = 5
tombstone_s = 30.0
"""
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@dataclass
class Remote:
    child: ChildProcess
    node_id: str
    address: str
    key_file: str


@dataclass
class Swarm:
    config_path: str
    nodes: list[DhtNode]
    remotes: list[Remote]
    client: RpcClient
    tmp: object
    stack: contextlib.ExitStack
    run: object = None
    created: list[DhtNode] = field(default_factory=list)  # every node ever started, for teardown
    spawned: list[Remote] = field(default_factory=list)  # every process ever started, likewise

    async def new_node(
        self, bootstrap: list[str], key: NodeKey | None = None, listen="127.0.0.1:0"
    ) -> DhtNode:
        node = DhtNode(key=key or NodeKey.generate(), config=self.run.dht, bootstrap=bootstrap, listen=listen)
        self.created.append(node)
        await node.start()
        return node

    @property
    def seed(self) -> DhtNode:
        return self.nodes[0]

    async def spawn_remote(self, key_file: str, bootstrap: str) -> Remote:
        child = self.stack.enter_context(
            spawn_python(
                [
                    "-m",
                    "agora_core",
                    "dht",
                    "serve",
                    "--bootstrap",
                    bootstrap,
                    "--config",
                    self.config_path,
                    "--key-file",
                    key_file,
                    "--status-interval",
                    "60",
                    "--log-format",
                    "json",
                ]
            )
        )
        # Read in a thread: the in-process nodes must keep serving the newcomer's join.
        node_id = await asyncio.to_thread(child.read_until, "agora dht node ")
        address = await asyncio.to_thread(child.read_until, "  serving    ")
        remote = Remote(child, node_id, address, key_file)
        self.spawned.append(remote)
        return remote

    async def views(self) -> dict[str, set[str]]:
        """Each live node's view: the ids it holds alive or suspect."""
        views = {node.node_id: {m.node_id for m in node.members()} for node in self.nodes}
        for remote in self.remotes:
            reply = await self.client.call(remote.address, "dht.members", timeout_s=5)
            views[remote.node_id] = {m[0] for m in member_list.unpack(reply.meta, reply.tensors)}
        return views

    def live_ids(self) -> set[str]:
        return {n.node_id for n in self.nodes} | {r.node_id for r in self.remotes}

    async def agree(self) -> bool:
        """Every live node's view is exactly the live nodes."""
        expected = self.live_ids()
        return all(view == expected for view in (await self.views()).values())

    async def stop_all(self) -> None:
        """Stop every node and process this swarm ever started (the in-process ones bounded)."""
        stops = asyncio.gather(*(node.stop(leave=False) for node in self.created), return_exceptions=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stops, 30)
        await asyncio.gather(*(asyncio.to_thread(r.child.stop) for r in self.spawned))


@contextlib.asynccontextmanager
async def running_swarm(tmp: Path, *, in_process: int, processes: int) -> AsyncIterator[Swarm]:
    """``in_process`` nodes here and ``processes`` OS processes, yielded once every view holds
    every node; all of them are stopped when the block exits, whatever happened inside it."""
    config_path = tmp / "fast.toml"
    config_path.write_text(FAST_DHT)
    async with contextlib.AsyncExitStack() as cleanup:  # on exit, each step runs even if one fails
        client = RpcClient()
        cleanup.push_async_callback(client.close)
        children = cleanup.enter_context(contextlib.ExitStack())
        swarm = Swarm(str(config_path), [], [], client, tmp, children, load_run_config(config_path))
        cleanup.push_async_callback(swarm.stop_all)
        swarm.nodes.append(await swarm.new_node([]))
        for _ in range(in_process - 1):
            swarm.nodes.append(await swarm.new_node([swarm.seed.address]))
        swarm.remotes = list(
            await asyncio.gather(
                *(
                    swarm.spawn_remote(str(tmp / f"remote{i}.key"), swarm.nodes[i % 4].address)
                    for i in range(processes)
                )
            )
        )
        await poll_until(swarm.agree, timeout_s=30, what="one membership view")
        yield swarm


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(tmp_path_factory):
    """The shared swarm: tests may read, write and pause a node, never kill or add one."""
    async with running_swarm(
        tmp_path_factory.mktemp("dht"), in_process=IN_PROCESS, processes=PROCESSES
    ) as swarm:
        yield swarm


async def test_all_38_nodes_hold_one_membership_view(swarm):
    views = await swarm.views()
    assert len(views) == len(swarm.live_ids()) == IN_PROCESS + PROCESSES
    assert all(view == swarm.live_ids() for view in views.values())


async def test_a_value_stored_via_any_node_is_read_via_any_other(swarm):
    rng = random.Random(1)
    expiration = time.time() + 300
    for i in range(20):
        writer, reader = rng.sample(swarm.nodes, 2)
        assert await writer.store(f"any/{i}", "v", {"i": i, "by": writer.node_id}, expiration) >= 1
        got = await reader.get(f"any/{i}")
        assert got["v"].value == {"i": i, "by": writer.node_id}
    many = await swarm.nodes[5].get_many([f"any/{i}" for i in range(20)] + ["any/missing"])
    assert [many[f"any/{i}"]["v"].value["i"] for i in range(20)] == list(range(20))
    assert many["any/missing"] == {}


async def test_a_key_holding_more_than_a_header_carries_travels_whole(swarm):
    # 400 entries of ~600 bytes: some 250 KiB under one key, four times what a header holds
    # (a stage of a thousand workers announces about as much); replies carry it as bulk
    expiration = time.time() + 300
    writer = swarm.nodes[7]
    entries = {f"w{i:03d}": {"i": i, "pad": "x" * 600} for i in range(400)}
    for start in range(0, len(entries), 50):
        batch = list(entries.items())[start : start + 50]
        stored = await asyncio.gather(*(writer.store("big/key", s, v, expiration) for s, v in batch))
        assert min(stored) >= 1
    got = await swarm.nodes[20].get("big/key")
    assert {s: v.value for s, v in got.items()} == entries
    # every replica answers a raw dht.get with all of it (in a data frame, not the header)
    for replica in swarm.seed.replicas("big/key"):
        reply = await swarm.client.call(replica.address, "dht.get", {"keys": ["big/key"]}, timeout_s=5)
        assert (
            "records" not in reply.meta
            and len(bulk.unpack("records", reply.meta, reply.tensors)["big/key"]) == 400
        )


async def test_watch_yields_the_value_now_and_on_every_change(swarm):
    watcher, writer = swarm.nodes[11], swarm.nodes[12]
    await writer.store("watched", "v", 0, time.time() + 60)
    seen = []
    async with asyncio.timeout(20):
        async for value in watcher.watch("watched", interval_s=PERIOD_S / 3):
            seen.append(value["v"].value)
            if seen[-1] == 2:
                break
            await writer.store("watched", "v", seen[-1] + 1, time.time() + 60 + seen[-1])
    assert seen == [0, 1, 2]


async def test_owned_subkeys_are_protected_by_every_replica(swarm):
    owner, mallory = NodeKey.generate(), NodeKey.generate()
    key, subkey = "stage/0/workers", owned_subkey(owner.public_key)
    await swarm.nodes[1].store(key, subkey, {"address": "w0"}, time.time() + 120, signer=owner)
    good = make_record(key, subkey, {"address": "w0"}, time.time() + 120, signer=owner)
    evil_value = msgpack.packb({"address": "evil"})
    attacks = {
        "unsigned": [key, subkey, [evil_value, good.expiration + 10, None, None]],
        "forged": [key, subkey, [evil_value, good.expiration + 10, bytes(64), owner.public_key]],
        "other owner": [
            key,
            subkey,
            make_record(
                key,
                owned_subkey(mallory.public_key),
                {"address": "evil"},
                good.expiration + 10,
                signer=mallory,
            ).to_wire(),
        ],
        "tampered value": [key, subkey, [evil_value, good.expiration, good.signature, owner.public_key]],
        "tampered expiration": [
            key,
            subkey,
            [good.value, good.expiration + 10, good.signature, owner.public_key],
        ],
    }
    # Straight to every replica, bypassing the writer's own checks.
    for replica in swarm.nodes[0].replicas(key):
        reply = await swarm.client.call(
            replica.address, "dht.store", {"items": list(attacks.values()), "now": time.time()}, timeout_s=5
        )
        assert reply.meta["stored"] == [False] * len(attacks)
        assert all(reply.meta["errors"]), reply.meta["errors"]
    older = make_record(key, subkey, {"address": "old"}, time.time() + 60, signer=owner)  # a replay
    assert await swarm.nodes[2].store(key, subkey, {"address": "old"}, older.expiration, signer=owner) >= 1
    value = (await swarm.nodes[7].get(key))[subkey]
    assert value.value == {"address": "w0"} and value.owner == owner.public_key
    with pytest.raises(RecordRejected):
        await swarm.nodes[3].store(key, subkey, {"address": "evil"}, time.time() + 500, signer=mallory)


async def test_records_expire_and_deletes_hide_them(swarm):
    await swarm.nodes[4].store("short/lived", "s", 1, time.time() + 1.0)
    assert (await swarm.nodes[9].get("short/lived"))["s"].value == 1
    await wait_until_async_get(swarm.nodes[10], "short/lived", lambda v: v == {}, timeout_s=10)
    await swarm.nodes[4].store("to/delete", "s", 1, time.time() + 120)
    await swarm.nodes[6].delete("to/delete", "s")
    assert await swarm.nodes[8].get("to/delete") == {}
    with pytest.raises(RecordRejected, match="ahead"):
        await swarm.nodes[4].store("far/future", "s", 1, time.time() + 10 * 86400)


async def wait_until_async_get(node, key, predicate, *, timeout_s):
    async def check():
        return predicate(await node.get(key))

    await poll_until(check, timeout_s=timeout_s, what=f"{key} to satisfy the condition")


async def test_a_stalled_node_is_suspected_but_refutes_and_is_not_removed(swarm):
    remote = swarm.remotes[0]
    # The tables count every transition, so a brief one cannot slip between two looks.
    suspicions = sum(node.table.suspicions for node in swarm.nodes)
    deaths = sum(node.table.deaths for node in swarm.nodes)
    os.kill(remote.child.pid, signal.SIGSTOP)  # a long GC pause, an overloaded host
    try:
        await wait_until_async(
            lambda: sum(node.table.suspicions for node in swarm.nodes) > suspicions,
            timeout_s=3,
            what="a suspicion",
        )
    finally:
        os.kill(remote.child.pid, signal.SIGCONT)

    async def alive_everywhere():
        return all(node.table.get(remote.node_id).status == Status.ALIVE for node in swarm.nodes)

    await poll_until(alive_everywhere, timeout_s=10, what="the refutation to spread")
    assert sum(node.table.deaths for node in swarm.nodes) == deaths  # suspected, never declared dead


# Its own swarm (up to 60 s to start and 30 s to agree), three waits of 30 s, 30 s to stop.
@pytest.mark.timeout(300)
async def test_killing_a_quarter_of_the_swarm_keeps_every_record_with_a_surviving_replica(tmp_path):
    async with running_swarm(tmp_path, in_process=16, processes=4) as swarm:
        expiration = time.time() + 600
        keys = [f"churn/{i}" for i in range(120)]
        await asyncio.gather(
            *(swarm.nodes[i % 8].store(key, "v", key, expiration) for i, key in enumerate(keys))
        )
        replicas_before = {key: {m.node_id for m in swarm.seed.replicas(key)} for key in keys}

        victims = swarm.nodes[-4:]  # 4 in-process + 1 process = 5 of 20
        dead_remotes = swarm.remotes[-1:]
        for node in victims:
            await node.stop(leave=False)  # abrupt: no goodbye
        for remote in dead_remotes:
            remote.child.kill()
        swarm.nodes = swarm.nodes[:-4]
        swarm.remotes = swarm.remotes[:-1]
        dead = {n.node_id for n in victims} | {r.node_id for r in dead_remotes}
        survivors = {key for key, ids in replicas_before.items() if ids - dead}
        assert len(survivors) >= 0.8 * len(keys)  # R=3 of 20: few keys lose every replica

        async def all_readable():
            found = await swarm.nodes[3].get_many(sorted(survivors))
            return all(found[key].get("v") is not None for key in survivors)

        await poll_until(all_readable, timeout_s=30, what="every surviving record to be readable")
        await poll_until(swarm.agree, timeout_s=30, what="the dead to leave every view")

        async def replicated_again():  # anti-entropy restored R copies on the new replica sets
            for key in sorted(survivors)[:30]:
                for member in swarm.seed.replicas(key):
                    node = next((n for n in swarm.nodes if n.node_id == member.node_id), None)
                    if node is not None and not node.records.get(key, now=time.time()):
                        return False
            return True

        await poll_until(replicated_again, timeout_s=30, what="records on their new replicas")


async def test_new_nodes_take_over_their_share(tmp_path):
    async with running_swarm(tmp_path, in_process=12, processes=0) as swarm:
        expiration = time.time() + 600
        keys = [f"share/{i}" for i in range(60)]
        stored = await asyncio.gather(
            *(swarm.nodes[i % 6].store(key, "v", key, expiration) for i, key in enumerate(keys))
        )
        assert min(stored) >= 1
        newcomers = [await swarm.new_node([swarm.nodes[1].address]) for _ in range(4)]
        swarm.nodes.extend(newcomers)

        def share(node: DhtNode) -> list[str]:  # the keys a node is now a replica of
            return [k for k in keys if node.node_id in {m.node_id for m in swarm.seed.replicas(k)}]

        async def held():
            if any(len(n.members()) != len(swarm.live_ids()) for n in swarm.nodes):
                return False  # the swarm does not agree on who is in it yet
            return all(n.records.get(k, now=time.time()) for n in newcomers for k in share(n))

        await poll_until(held, timeout_s=30, what="newcomers to hold their keys")
        assert sum(len(share(n)) for n in newcomers) > 0  # they did take over something


async def test_a_restarted_node_rejoins(tmp_path):
    async with running_swarm(tmp_path, in_process=10, processes=2) as swarm:
        victim = swarm.nodes[-1]
        key, address = victim.key, victim.address.removeprefix("tcp://")
        old_incarnation = victim.table.me.incarnation
        await victim.stop(leave=False)
        swarm.nodes.remove(victim)

        async def gone():
            return all(key.node_id not in view for view in (await swarm.views()).values())

        await poll_until(gone, timeout_s=30, what="the crash to be noticed")
        reborn = await swarm.new_node([swarm.nodes[0].address], key=key, listen=address)
        swarm.nodes.append(reborn)
        assert reborn.table.me.incarnation > old_incarnation
        await poll_until(swarm.agree, timeout_s=30, what="the restarted node in every view")
