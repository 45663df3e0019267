"""Failure injection through the DHT: who may order one, which nodes obey it, and only once.

One real DHT node on 127.0.0.1 holds the records and carries the watcher under test; the
operator writes through the same node with its own key, as ``tools/inject.py`` would through
any member. The effects are recorded, not carried out (the exit and hang of real processes
are agora-worker's test_injection_processes.py's).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from agora_core.auth.peers import PeerVerifier
from agora_core.config import OperatorConfig
from agora_core.config.run import DhtConfig
from agora_core.dht import DhtNode, DhtValue
from agora_core.errors import DeadlineExceeded, PeerUnreachable
from agora_core.identity import NodeKey
from agora_core.injection import (
    InjectionPoints,
    InjectionRejected,
    InjectionWatcher,
    NodeEffects,
    OperatorKeys,
    Targets,
    Trigger,
    injections_key,
)
from agora_core.injection.publish import clear, list_injections, new_injection, publish
from agora_core.injection.record import NodeTraits, record_subkey, selected_by_fraction
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient, RpcServer
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import wait_until_async

RUN = "inject-test"


@dataclasses.dataclass
class Effects:
    """NodeEffects that write down what they were asked to do."""

    done: list[tuple] = dataclasses.field(default_factory=list)

    def node_effects(self) -> NodeEffects:
        return NodeEffects(
            drop_link=lambda s: self.done.append(("drop_link", s)),
            slow=lambda f, s: self.done.append(("slow", f, s)),
            corrupt_next_gradient=lambda: self.done.append(("nan",)),
        )


@pytest.fixture
async def dht():
    node = DhtNode(key=NodeKey.generate(), config=DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1))
    await node.start()
    yield node
    await node.stop()


def watcher_on(dht: DhtNode, operator: NodeKey, effects: Effects, **traits) -> InjectionWatcher:
    config = OperatorConfig(public_keys=[operator.public_key.hex()], injection_watch_s=0.05)
    return InjectionWatcher(
        dht=dht,
        run_name=RUN,
        interval_s=config.injection_watch_s,
        operators=OperatorKeys(config),
        role=traits.get("role", "worker"),
        stage=traits.get("stage", 1),
        points=InjectionPoints(),
        effects=effects.node_effects(),
        metrics=NodeMetrics(role="worker"),
    )


@pytest.fixture
async def watching(dht):
    """(the watcher, reading every 50 ms; the operator's key; what the node was told to do)."""
    operator, effects = NodeKey.generate(), Effects()
    watcher = watcher_on(dht, operator, effects)
    await watcher.start()
    yield watcher, operator, effects
    await watcher.stop()


def obeyed(watcher: InjectionWatcher, record: str, action: str) -> float:
    labels = {"record": record, "action": action}
    return watcher.metrics.sample_value("agora_injections_obeyed_total", labels) or 0.0


def ignored(watcher: InjectionWatcher, reason: str) -> float:
    return watcher.metrics.sample_value("agora_injections_ignored_total", {"reason": reason}) or 0.0


async def test_a_record_signed_by_a_key_that_is_not_an_operator_is_ignored_and_counted(dht, watching):
    watcher, _operator, effects = watching
    stranger = NodeKey.generate()
    forged = new_injection(trigger="now", action="slow", factor=2.0, duration_s=1.0)
    await publish(dht, stranger, RUN, forged)
    await wait_until_async(lambda: ignored(watcher, "not_operator") == 1, what="the forged record ignored")
    await watcher.poll()  # read again: still counted once
    assert ignored(watcher, "not_operator") == 1 and effects.done == [] and not watcher.obeyed


async def test_an_operator_record_fires_once_however_often_it_is_read_or_rewritten(dht, watching):
    watcher, operator, effects = watching
    injection = new_injection(trigger="now", action="slow", factor=3.0, duration_s=2.0)
    await publish(dht, operator, RUN, injection)
    await wait_until_async(lambda: effects.done, what="the record obeyed")
    for _ in range(3):
        await watcher.poll()
    later = dataclasses.replace(injection, expires=injection.expires + 30)  # same id, refreshed
    await publish(dht, operator, RUN, later)
    await watcher.poll()
    assert effects.done == [("slow", 3.0, 2.0)]
    assert obeyed(watcher, injection.id, "slow") == 1 and list(watcher.obeyed) == [injection.id]
    listed = await list_injections(dht, RUN)
    assert [item.injection.id for item in listed] == [injection.id]
    assert await clear(dht, operator, RUN) == [injection.id]
    assert await list_injections(dht, RUN) == []


async def test_malformed_records_and_unknown_actions_are_ignored_counted_and_harmless(dht, watching):
    watcher, operator, effects = watching
    good = new_injection(trigger="now", action="nan").to_value()
    bad = {
        "unknown-action": {**good, "id": "unknown-action", "action": "explode"},
        "unknown-trigger": {**good, "id": "unknown-trigger", "trigger": "someday"},
        "no-expiry": {**good, "id": "no-expiry", "expires": "soon"},
        "not-a-map": [1, 2, 3],
        "bad-targets": {**good, "id": "bad-targets", "targets": {"fraction": 7}},
    }
    expiration = time.time() + 30
    for record_id, value in bad.items():
        await dht.store(
            injections_key(RUN),
            record_subkey(operator.public_key, record_id),
            value,
            expiration,
            signer=operator,
        )
    await wait_until_async(lambda: ignored(watcher, "malformed") == 3, what="three malformed records")
    assert ignored(watcher, "unknown_action") == 1 and ignored(watcher, "unknown_trigger") == 1
    assert effects.done == []
    await publish(dht, operator, RUN, new_injection(trigger="now", action="nan"))  # still listening
    await wait_until_async(lambda: effects.done == [("nan",)], what="a good record after the bad ones")


async def test_after_triggers_wait_and_armed_triggers_fire_at_their_point_once(dht, watching):
    watcher, operator, effects = watching
    after = new_injection(trigger="after", action="drop_link", after_s=0.3, duration_s=1.5)
    send = new_injection(trigger="averaging_send", action="slow", factor=2.0, duration_s=1.0, at_chunk=2)
    for injection in (after, send):
        await publish(dht, operator, RUN, injection)
    await wait_until_async(lambda: watcher.points.armed, what="the averaging-send trigger armed")
    assert effects.done == [] and watcher.info()["scheduled"] == [after.id]
    points = watcher.points
    points.reached(Trigger.FORWARD)  # another point: nothing
    points.reached(Trigger.AVERAGING_SEND, index=1, count=10)  # before chunk 2: nothing
    assert ("slow", 2.0, 1.0) not in effects.done
    points.reached(Trigger.AVERAGING_SEND, index=2, count=10)
    points.reached(Trigger.AVERAGING_SEND, index=3, count=10)  # fired already
    assert effects.done.count(("slow", 2.0, 1.0)) == 1 and not points.armed
    await wait_until_async(lambda: ("drop_link", 1.5) in effects.done, what="the timed trigger")
    assert time.time() >= after.fires_at()


def test_a_counted_trigger_fires_at_the_last_chunk_of_a_short_slice_and_expires_unreached():
    points, fired = InjectionPoints(), []
    points.obey = lambda injection, where: fired.append((injection.id, where))
    short = new_injection(trigger="averaging_send", action="nan", at_chunk=5, record_id="short")
    stale = new_injection(trigger="download", action="nan", record_id="stale", ttl_s=0.01)
    points.arm(short)
    points.arm(stale)
    points.reached(Trigger.AVERAGING_SEND, index=0, count=2)
    points.reached(Trigger.AVERAGING_SEND, index=1, count=2)  # the last of two chunks
    assert fired == [("short", "averaging_send")]
    assert [i.id for i in points.expire(time.time() + 1)] == ["stale"] and not points.armed


def test_targets_pick_nodes_by_id_stage_role_and_a_fraction_that_needs_no_coordination():
    now = time.time()
    worker = NodeTraits(node_id="ab" * 20, role="worker", stage=1, started=now - 10)
    trainer = NodeTraits(node_id="cd" * 20, role="trainer", stage=None, started=now - 10)
    joiner = dataclasses.replace(worker, started=now + 5)
    assert Targets().selects("r", now, worker) and Targets().selects("r", now, trainer)
    assert Targets(nodes=("abababab",)).selects("r", now, worker)
    assert not Targets(nodes=("abababab",)).selects("r", now, trainer)
    assert Targets(stage=1).selects("r", now, worker) and not Targets(stage=1).selects("r", now, trainer)
    assert not Targets(role="worker").selects("r", now, trainer)
    # a node that started after the record was issued obeys it only when it says joiners
    assert not Targets(stage=1).selects("r", now, joiner)
    assert Targets(stage=1, joiners=True).selects("r", now, joiner)
    # each node decides alone from (record id, node id): a fraction of them, not a fixed set
    ids = [NodeKey.from_seed(bytes([i % 256, i // 256]) + bytes(30)).node_id for i in range(2000)]
    picked = {r: {n for n in ids if selected_by_fraction(r, n, 0.3)} for r in ("one", "two")}
    assert all(abs(len(p) / len(ids) - 0.3) < 0.04 for p in picked.values())
    assert picked["one"] != picked["two"]
    assert picked["one"] == {n for n in ids if selected_by_fraction("one", n, 0.3)}


def test_an_authorized_run_takes_operator_credentials_and_the_authorizers_key_only():
    authority, operator, worker = TestAuthority(run=RUN), NodeKey.generate(), NodeKey.generate()
    verifier = PeerVerifier(run=RUN, authorizer_key=authority.key.public_key)
    keys = OperatorKeys(OperatorConfig(), verifier)

    def check(writer: NodeKey, credential) -> None:
        injection = new_injection(trigger="now", action="nan", credential=credential)
        subkey = record_subkey(writer.public_key, injection.id)
        found = DhtValue(injection.to_value(), injection.expires, writer.public_key, writer.public_key)
        keys.check(subkey, found, injection)

    check(operator, authority.credential(operator, role="operator", stage=None).to_value())
    check(authority.key, None)  # the authorizer is an operator by its key alone
    for writer, credential, reason in (
        (worker, authority.credential(worker, role="worker").to_value(), "a worker's"),
        (operator, None, "no credential"),
        (operator, authority.credential(worker, role="operator", stage=None).to_value(), "another key"),
    ):
        with pytest.raises(InjectionRejected) as refused:
            check(writer, credential)
        assert refused.value.reason == "not_operator", reason
    # an open run knows no credentials: only the keys its config lists
    with pytest.raises(InjectionRejected):
        OperatorKeys(OperatorConfig()).check(
            record_subkey(authority.key.public_key, "x"),
            DhtValue({}, 0.0, authority.key.public_key, authority.key.public_key),
            new_injection(trigger="now", action="nan", record_id="x"),
        )


async def test_a_dropped_link_answers_nothing_for_its_duration_then_recovers():
    server = RpcServer(listen="127.0.0.1:0")
    server.register("echo", lambda request: None)
    address = await server.start()
    client = RpcClient()
    try:
        await client.call(address, "echo", timeout_s=5)
        server.drop_link(0.4)
        with pytest.raises(DeadlineExceeded):
            await client.call(address, "echo", timeout_s=0.2)
        deadline = time.monotonic() + 5
        while True:  # the link comes back by itself
            try:
                await client.call(address, "echo", timeout_s=0.2)
                break
            except DeadlineExceeded:
                assert time.monotonic() < deadline, "the link never came back"
        client.drop_link(0.3)  # the caller's side: its requests go nowhere
        with pytest.raises(DeadlineExceeded):
            await client.call(address, "echo", timeout_s=0.1)
    finally:
        await client.close()
        await server.stop()


async def three_nodes(config: DhtConfig) -> list[DhtNode]:
    """A seed and two members that joined through it, started (the caller stops them)."""
    nodes = [DhtNode(key=NodeKey.generate(), config=config)]
    await nodes[0].start()
    for _ in range(2):
        nodes.append(DhtNode(key=NodeKey.generate(), config=config, bootstrap=[nodes[0].address]))
        await nodes[-1].start()
    return nodes


async def test_a_node_whose_link_dropped_past_the_suspicion_timeout_rejoins_when_it_returns():
    config = DhtConfig(gossip_period_s=0.1, probe_timeout_s=0.05, suspicion_timeout_s=0.4, sync_periods=2)
    nodes = await three_nodes(config)
    seed, _other, cut = nodes
    try:
        await wait_until_async(lambda: all(len(n.members()) == 3 for n in nodes), what="three members each")
        cut.server.drop_link(1.5)
        cut.client.drop_link(1.5)
        # each side declares the other dead: nobody probes the dead, so only a rejoin heals it
        await wait_until_async(
            lambda: cut.live_ids() == {cut.node_id} and cut.node_id not in seed.live_ids(),
            timeout_s=10,
            what="the cut-off node and the swarm to give up on each other",
        )
        await wait_until_async(
            lambda: all(n.live_ids() == {m.node_id for m in nodes} for n in nodes),
            timeout_s=15,
            what="the swarm whole again after the link came back",
        )
    finally:
        for node in nodes:
            await node.stop()


async def test_a_member_held_dead_by_one_node_alone_is_revisited_and_refutes_long_before_its_tombstone_expires():
    # what a trainer whose link dropped for a few seconds is left with: some of the members it
    # probed meanwhile are dead in its eyes, while they, and the rest, never heard of it
    config = DhtConfig(
        gossip_period_s=0.1, probe_timeout_s=0.05, suspicion_timeout_s=0.4, sync_periods=1000, tombstone_s=600
    )
    nodes = await three_nodes(config)
    holder, wronged, _other = nodes
    try:
        await wait_until_async(lambda: all(len(n.members()) == 3 for n in nodes), what="three members each")
        incarnation = wronged.table.me.incarnation
        assert holder.table.drop(lambda m: m.node_id == wronged.node_id) == 1  # dead here, told nobody
        assert holder.gone(wronged.node_id) and wronged.node_id not in holder.live_ids()
        await wait_until_async(
            lambda: wronged.node_id in holder.live_ids(), timeout_s=10, what="the wronged member alive again"
        )
        assert wronged.table.me.incarnation > incarnation  # it refuted: told it was dead, by a revisit
        assert not holder.gone(wronged.node_id)
    finally:
        for node in nodes:
            await node.stop()


async def test_calls_in_flight_to_a_member_declared_dead_fail_at_once_not_at_their_deadline():
    config = DhtConfig(gossip_period_s=0.1, probe_timeout_s=0.05, suspicion_timeout_s=0.4)
    caller = DhtNode(key=NodeKey.generate(), config=config)
    await caller.start()
    frozen = DhtNode(key=NodeKey.generate(), config=config, bootstrap=[caller.address])
    never = asyncio.Event()

    async def wait_forever(request):
        await never.wait()

    frozen.server.register("wait", wait_forever)
    await frozen.start()
    try:
        call = asyncio.create_task(caller.client.call(frozen.address, "wait", timeout_s=30))
        # in flight: the frozen node's handler holds it (then the link drops)
        await wait_until_async(lambda: frozen.server.inflight == 1, what="the call to reach its handler")
        frozen.server.drop_link(10)  # its handler stays busy and it answers no probe
        frozen.client.drop_link(10)
        started = time.monotonic()
        with pytest.raises(PeerUnreachable, match="declared dead"):
            await call
        assert time.monotonic() - started < 10  # the suspicion timeout, not the 30 s deadline
    finally:
        never.set()
        for node in (frozen, caller):
            await node.stop(leave=False)
