"""DHT rules without a network: record ownership, newest-wins, limits, SWIM precedence."""

from __future__ import annotations

import dataclasses
import random
import time

import pytest

from agora_core.dht.claims import Claims
from agora_core.dht.gossip_queue import GossipQueue
from agora_core.dht.ids import Ring, closest, key_id
from agora_core.dht.membership import Member, MemberTable, Status, parse_update
from agora_core.dht.records import Record, RecordRejected, make_record, owned_subkey, subkey_owner
from agora_core.dht.storage import RecordStore, StoreLimits, Validators
from agora_core.identity import NodeKey

NOW = time.time()
KEY = "stage/1/workers"


@pytest.fixture
def owner():
    return NodeKey.from_seed(bytes(range(32)))


@pytest.fixture
def store():
    return RecordStore(
        StoreLimits(max_value_bytes=64, max_subkeys=3, max_expiration_ahead_s=600, max_clock_skew_s=5)
    )


def accept(store, key, subkey, record, sender_now=None):
    store.validate(key, subkey, record, now=NOW, sender_now=sender_now)
    return store.put(key, subkey, record, now=NOW)


def test_owned_subkey_names_its_owner(owner):
    subkey = owned_subkey(owner.public_key, "gpu0")
    assert subkey_owner(subkey) == owner.public_key
    assert subkey_owner("open") is None
    with pytest.raises(RecordRejected):
        subkey_owner("@not-hex")


def test_owner_signed_record_is_accepted(store, owner):
    subkey = owned_subkey(owner.public_key)
    assert accept(store, KEY, subkey, make_record(KEY, subkey, {"a": 1}, NOW + 60, signer=owner))
    assert store.get(KEY, now=NOW)[subkey].decoded() == {"a": 1}


def test_unsigned_forged_and_foreign_writes_to_owned_subkeys_are_rejected(store, owner):
    subkey = owned_subkey(owner.public_key)
    mallory = NodeKey.generate()
    genuine = make_record(KEY, subkey, {"a": 1}, NOW + 60, signer=owner)
    forged_signature = dataclasses.replace(genuine, signature=bytes(64))
    signed_by_other = dataclasses.replace(
        genuine,
        signature=make_record(
            KEY, owned_subkey(mallory.public_key), {"a": 1}, NOW + 60, signer=mallory
        ).signature,
    )
    unsigned = dataclasses.replace(genuine, signature=None)
    wrong_writer = make_record(KEY, owned_subkey(mallory.public_key), {"a": 1}, NOW + 60, signer=mallory)
    tampered_value = dataclasses.replace(genuine, value=make_record(KEY, "x", {"a": 2}, NOW + 60).value)
    tampered_expiration = dataclasses.replace(genuine, expiration=NOW + 500)
    other_key = ("stage/2/workers", subkey, genuine)  # a signature does not travel to another key
    for bad in (
        forged_signature,
        signed_by_other,
        unsigned,
        wrong_writer,
        tampered_value,
        tampered_expiration,
    ):
        with pytest.raises(RecordRejected):
            accept(store, KEY, subkey, bad)
    with pytest.raises(RecordRejected):
        accept(store, *other_key)
    with pytest.raises(RecordRejected, match="owned"):
        make_record(KEY, subkey, 1, NOW + 60, signer=mallory)
    assert store.get(KEY, now=NOW) == {}


def test_newest_expiration_wins_and_replays_of_older_records_lose(store, owner):
    subkey = owned_subkey(owner.public_key)
    old = make_record(KEY, subkey, "v1", NOW + 60, signer=owner)
    new = make_record(KEY, subkey, "v2", NOW + 120, signer=owner)
    assert accept(store, KEY, subkey, old)
    assert accept(store, KEY, subkey, new)
    assert not accept(store, KEY, subkey, old)  # a replay, validly signed but older
    assert store.get(KEY, now=NOW)[subkey].decoded() == "v2"


def test_ties_resolve_the_same_way_on_every_replica(store):
    a, b = make_record(KEY, "s", "a", NOW + 60), make_record(KEY, "s", "b", NOW + 60)
    other = RecordStore()
    accept(store, KEY, "s", a), accept(store, KEY, "s", b)
    accept(other, KEY, "s", b), accept(other, KEY, "s", a)
    assert store.get(KEY, now=NOW)["s"] == other.get(KEY, now=NOW)["s"]


def test_expired_records_are_invisible_then_purged(store):
    accept(store, KEY, "s", make_record(KEY, "s", 1, NOW + 10))
    assert store.get(KEY, now=NOW + 11) == {}
    assert not store.put(KEY, "t", make_record(KEY, "t", 1, NOW - 1), now=NOW)
    assert store.purge(NOW + 11) == 1 and len(store) == 0


def test_limits_and_clock_bounds_are_enforced_on_receive(store):
    with pytest.raises(RecordRejected, match="ahead"):
        accept(store, KEY, "s", make_record(KEY, "s", 1, NOW + 3600))
    with pytest.raises(RecordRejected, match="clock"):
        accept(store, KEY, "s", make_record(KEY, "s", 1, NOW + 60), sender_now=NOW - 30)
    with pytest.raises(RecordRejected, match="bytes"):
        accept(store, KEY, "s", make_record(KEY, "s", "x" * 100, NOW + 60))
    for i in range(3):
        accept(store, KEY, f"s{i}", make_record(KEY, f"s{i}", i, NOW + 60))
    with pytest.raises(RecordRejected, match="subkeys"):
        accept(store, KEY, "s3", make_record(KEY, "s3", 3, NOW + 60))
    assert accept(store, KEY, "s0", make_record(KEY, "s0", 9, NOW + 70))  # updates still fit
    with pytest.raises(RecordRejected):
        Record.from_wire([b"x", "soon", None])


def test_validators_apply_by_key_prefix():
    def worker_schema(key, subkey, value):
        if not isinstance(value, dict) or "address" not in value:
            raise RecordRejected("a worker announcement needs an address")

    validators = Validators()
    validators.register("stage/", worker_schema)
    store = RecordStore(validators=validators)
    with pytest.raises(RecordRejected, match="address"):
        accept(store, KEY, "s", make_record(KEY, "s", {"nope": 1}, NOW + 60))
    assert accept(store, KEY, "s", make_record(KEY, "s", {"address": "x"}, NOW + 60))
    assert accept(store, "trainer/1", "s", make_record("trainer/1", "s", {"nope": 1}, NOW + 60))


def test_replica_sets_are_the_closest_ids():
    ids = [(i * 1000, f"n{i}") for i in range(10)]
    target = 4300
    assert (
        closest(target, ids, 3) == sorted((n for _p, n in ids), key=lambda n: int(n[1:]) * 1000 ^ target)[:3]
    )
    assert key_id("a") != key_id("b") and key_id("a") == key_id("a")


def test_the_ring_ranks_exactly_as_a_full_sort_by_xor_distance():
    rng = random.Random(11)
    for size in (0, 1, 2, 3, 7, 60, 400):
        members = [(rng.getrandbits(160), f"n{i}") for i in range(size)]
        ring = Ring(members)
        for _ in range(50):
            # targets anywhere, and right on a member (distance 0) or next to one
            target = (
                rng.getrandbits(160)
                if not members or rng.random() < 0.5
                else rng.choice(members)[0] ^ rng.getrandbits(3)
            )
            for count in (1, 3, 5):
                assert ring.closest(target, count) == closest(target, members, count)


# --- SWIM precedence ------------------------------------------------------------------------


def member(node: NodeKey, incarnation: int, status: Status, address: str = "tcp://127.0.0.1:1") -> Member:
    """``node``'s own claim (ALIVE/LEFT), or an unsigned report about it (SUSPECT/DEAD)."""
    update = Member(node.node_id, address, node.public_key, incarnation, status)
    if status in (Status.ALIVE, Status.LEFT):
        Claims(key=node).sign(update)
    return update


def report(node: NodeKey, incarnation: int, status: Status) -> Member:
    """Someone else's report about ``node``, carrying ``node``'s ALIVE claim at that incarnation."""
    claim = member(node, incarnation, Status.ALIVE)
    claim.status = status
    return claim


@pytest.fixture
def table():
    me = NodeKey.generate()
    hints: list[str] = []
    table = MemberTable(
        Member(me.node_id, "tcp://127.0.0.1:1", me.public_key, 10, Status.ALIVE),
        claims=Claims(key=me),
        suspicion_timeout_s=5,
        tombstone_s=30,
        on_hint=lambda m: hints.append(m.node_id),
    )
    table.hints = hints
    return table


def test_swim_precedence_of_a_members_own_claims(table):
    other = NodeKey.generate()
    assert table.apply(member(other, 5, Status.ALIVE), now=0)
    assert not table.apply(member(other, 5, Status.ALIVE), now=0)  # nothing new
    assert table.suspect(other.node_id, now=0)  # this node's own failed probes
    assert not table.apply(member(other, 5, Status.ALIVE), now=0)  # alive(i) does not refute it
    assert table.apply(member(other, 6, Status.ALIVE), now=0)  # the member's own refutation
    assert table.get(other.node_id).status == Status.ALIVE
    assert table.apply(member(other, 6, Status.LEFT), now=0)
    assert not table.apply(member(other, 6, Status.ALIVE), now=0)  # stale gossip cannot revive
    assert [m.node_id for m in table.live()] == [table.me.node_id]
    assert table.apply(member(other, 7, Status.ALIVE, "tcp://127.0.0.1:2"), now=0)  # a restart
    assert table.get(other.node_id).address == "tcp://127.0.0.1:2"


def test_reports_by_others_are_hints_that_change_no_status(table):
    other = NodeKey.generate()
    table.apply(member(other, 5, Status.ALIVE), now=0)
    for status in (Status.SUSPECT, Status.DEAD):
        assert not table.apply(Member(other.node_id, "tcp://127.0.0.1:1", other.public_key, 99, status))
        assert not table.apply(report(other, 5, status))
    assert table.get(other.node_id).status == Status.ALIVE and table.get(other.node_id).incarnation == 5
    assert table.hints == [other.node_id] * 4  # each one makes this node probe it
    assert not table.apply(report(other, 4, Status.DEAD)) and len(table.hints) == 4  # stale: ignored


def test_claims_not_signed_by_their_member_are_refused(table):
    other, mallory = NodeKey.generate(), NodeKey.generate()
    table.apply(member(other, 5, Status.ALIVE), now=0)
    forged = member(other, 1 << 40, Status.LEFT)
    forged.signature = mallory.sign(b"anything")
    assert not table.apply(forged)
    unsigned = Member(other.node_id, "tcp://127.0.0.1:9", other.public_key, 1 << 40, Status.ALIVE)
    assert not table.apply(unsigned)
    moved = member(other, 6, Status.ALIVE)
    moved.address = "tcp://127.0.0.1:9"  # the signature covers the address
    assert not table.apply(moved)
    assert (
        table.get(other.node_id).incarnation == 5 and table.get(other.node_id).address == "tcp://127.0.0.1:1"
    )


def test_suspected_node_refutes_with_one_more_than_its_incarnation(table):
    me = table.me
    table.apply(Member(me.node_id, me.address, me.public_key, me.incarnation + 1000, Status.SUSPECT))
    assert me.incarnation == 10  # a report above my incarnation is not mine to follow
    table.apply(Member(me.node_id, me.address, me.public_key, me.incarnation, Status.SUSPECT))
    assert me.incarnation == 11 and table.refutations == 1
    gossip = {update[0]: update for update in table.piggyback(16)}
    assert gossip[me.node_id][3:5] == [11, Status.ALIVE]  # the refutation goes out, signed
    assert Claims(key=NodeKey.generate()).admit(parse_update(gossip[me.node_id]))
    table.apply(Member(me.node_id, me.address, me.public_key, me.incarnation, Status.SUSPECT))
    assert me.incarnation == 11 and table.refutations == 1  # a report again at once: not refuted yet


def test_a_previous_lifes_report_above_mine_is_outranked_only_when_my_key_signed_it(table):
    me, key = table.me, table.claims.key
    forged = report(NodeKey.generate(), me.incarnation + 5000, Status.DEAD)
    forged.node_id, forged.public_key = me.node_id, key.public_key  # my id, another key's signature
    table.apply(forged)
    assert me.incarnation == 10 and not table.outrank(forged)  # nobody else raises my incarnation
    # my previous life, restarted here on a clock behind its own: held dead at its incarnation
    table.apply(report(key, me.incarnation + 5000, Status.DEAD))
    assert me.incarnation == 5011 and table.refutations == 1
    assert table.outrank(report(key, 6000, Status.DEAD)) and me.incarnation == 6001  # a join's answer
    gossip = {update[0]: update for update in table.piggyback(16)}
    assert gossip[me.node_id][3:5] == [6001, Status.ALIVE]  # the new claim goes out, signed


def test_suspicion_times_out_into_death_and_tombstones_expire(table):
    other = NodeKey.generate()
    table.apply(member(other, 1, Status.ALIVE), now=0)
    table.suspect(other.node_id, now=0)
    table.expire(now=4)
    assert table.get(other.node_id).status == Status.SUSPECT
    table.expire(now=5)
    assert table.get(other.node_id).status == Status.DEAD
    table.expire(now=40)
    assert table.get(other.node_id) is None


def test_malformed_updates_are_ignored(table):
    node = NodeKey.generate()
    assert parse_update(["x", "a", b"k", 1, 0, None, None]) is None
    assert parse_update("garbage") is None
    assert table.apply_all([["x"], 5, None, "y"]) == 0
    good = member(node, 1, Status.ALIVE).to_wire()
    assert parse_update(good) is not None
    assert parse_update([NodeKey.generate().node_id, *good[1:]]) is None  # id not from its key


def test_gossip_goes_least_sent_first_and_retires_after_its_budget():
    queue = GossipQueue()
    for name in "abc":
        queue.put(name, [name])
    assert queue.take(2, budget=2) == [["a"], ["b"]]  # all unsent: oldest first
    assert queue.take(2, budget=2) == [["c"], ["a"]]  # c was never sent; a is now retired
    queue.put("b", ["b2"])  # news about b: sent 0 times again, the old update replaced
    assert queue.take(5, budget=2) == [["b2"], ["c"]] and len(queue) == 1  # c retired, b2 once
    queue.discard("c")  # gone already: nothing happens
    assert queue.take(5, budget=2) == [["b2"]] and not queue and queue.take(5, budget=2) == []


def test_claims_already_held_change_nothing_and_newer_ones_still_apply(table):
    other = NodeKey.generate()
    assert table.apply_all([member(other, 5, Status.ALIVE).to_wire()], now=0) == 1
    held = member(other, 5, Status.ALIVE).to_wire()
    held[5] = b"\0" * 64  # a bad signature on a claim already held: skipped, not an error
    assert table.apply_all([held, member(other, 4, Status.ALIVE).to_wire()], now=0) == 0
    assert table.apply_all([member(other, 6, Status.ALIVE, "tcp://127.0.0.1:2").to_wire()], now=0) == 1
    assert table.get(other.node_id).address == "tcp://127.0.0.1:2"
    forged = member(other, 7, Status.ALIVE).to_wire()
    forged[5] = b"\0" * 64  # a newer incarnation is checked in full
    assert table.apply_all([forged], now=0) == 0 and table.get(other.node_id).incarnation == 6
    # a tombstone from hearsay is lifted by the member's own claim at the same incarnation
    gone = NodeKey.generate()
    assert not table.apply(report(gone, 3, Status.DEAD), now=0)
    assert table.apply_all([member(gone, 3, Status.ALIVE).to_wire()], now=0) == 1
    assert table.get(gone.node_id).status == Status.ALIVE
