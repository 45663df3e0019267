"""Accusation records: their format, and that a node accuses only in its own name."""

from __future__ import annotations

import time

import pytest

from agora_core.admission.accusations import (
    MAX_ACCUSED,
    Accusation,
    AccuserRecord,
    CheckEvidence,
    Evidence,
    accusations_key,
    parse_accusations,
)
from agora_core.dht.records import RecordRejected, make_record, owned_subkey
from agora_core.dht.storage import RecordStore, Validators
from agora_core.dht.values import visible
from agora_core.identity import NodeKey
from agora_core.schema import register_validators

KEY = accusations_key("run")


def record(accuser: NodeKey, *accused: str, kind: str = "averaging_values") -> dict:
    evidence = (Evidence(round=7, slice=1, chunk=3, measured=2.5, radius=0.5),)
    accusations = tuple(Accusation(a, kind, rounds=3, at=1000.0, evidence=evidence) for a in accused)
    return AccuserRecord(accuser.node_id, 1, accusations, 1001.0).to_value()


@pytest.fixture
def store() -> RecordStore:
    validators = Validators()
    register_validators(validators, "run")
    return RecordStore(validators=validators)


def write(store: RecordStore, signer: NodeKey, value: dict) -> bool:
    now = time.time()
    subkey = owned_subkey(signer.public_key)
    stored = make_record(KEY, subkey, value, now + 600, signer=signer)
    store.validate(KEY, subkey, stored, now=now)
    return store.put(KEY, subkey, stored, now=now)


def test_an_accusation_round_trips_with_its_evidence():
    accuser = NodeKey.generate()
    value = record(accuser, "a" * 40, kind="averaging_weight")
    parsed = AccuserRecord.from_value(value)
    assert parsed.to_value() == value
    assert parsed.accusations[0].evidence[0] == Evidence(7, 1, 3, 2.5, 0.5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda v: v["accusations"][0].update(kind="rude"), "kind"),
        (lambda v: v["accusations"][0].update(rounds=0), "rounds"),
        (lambda v: v["accusations"][0].update(at=float("nan")), "at"),
        (lambda v: v["accusations"][0]["evidence"][0].__setitem__(3, -1.0), "measured"),
        (lambda v: v["accusations"][0].update(evidence=[[1, 1, 1, 1.0, 1.0]] * 17), "evidence"),
        (lambda v: v.update(accusations=v["accusations"] * (MAX_ACCUSED + 1)), "at most"),
        (lambda v: v.update(stage=-1), "stage"),
    ],
)
def test_malformed_accusations_are_refused(change, message):
    value = record(NodeKey.generate(), "a" * 40)
    change(value)
    with pytest.raises(RecordRejected, match=message):
        AccuserRecord.from_value(value)


def trainer_record(accuser: NodeKey, accused: str) -> dict:
    evidence = (CheckEvidence(check=12, stage=1, measured=1.4, agreed=0.2, tolerance=0.6),)
    accusation = Accusation(accused, "compute_output", rounds=3, at=1000.0, evidence=evidence)
    return AccuserRecord(accuser.node_id, None, (accusation,), 1001.0).to_value()


def test_a_trainers_spot_check_accusation_round_trips_and_is_refused_where_it_does_not_belong(store):
    trainer = NodeKey.generate()
    value = trainer_record(trainer, "a" * 40)
    parsed = AccuserRecord.from_value(value)
    assert parsed.to_value() == value and parsed.stage is None
    assert parsed.accusations[0].evidence[0] == CheckEvidence(12, 1, 1.4, 0.2, 0.6)
    assert write(store, trainer, value)
    # a trainer (no stage) accuses of compute only, a worker (a stage) of averaging only
    averaging = record(trainer, "a" * 40)
    averaging["stage"] = None
    with pytest.raises(RecordRejected, match="without a stage accuses of"):
        AccuserRecord.from_value(averaging)
    staged = dict(value, stage=1)
    with pytest.raises(RecordRejected, match="with a stage accuses of"):
        AccuserRecord.from_value(staged)
    # evidence that does not show a mismatch is no evidence
    for bad in ([12, 1, 0.5, 0.2, 0.6], [12, 1, 1.4, 0.7, 0.6], [12, 1, 1.4, 0.2], [12, -1, 1.4, 0.2, 0.6]):
        value["accusations"][0]["evidence"] = [bad]
        with pytest.raises(RecordRejected, match="check evidence"):
            AccuserRecord.from_value(value)


def test_a_node_accuses_only_in_its_own_name_and_never_itself(store):
    accuser, framer = NodeKey.generate(), NodeKey.generate()
    assert write(store, accuser, record(accuser, "a" * 40))
    with pytest.raises(RecordRejected, match="accuser's own subkey"):
        write(store, framer, record(accuser, "b" * 40))  # an accusation in another's name
    with pytest.raises(RecordRejected, match="itself"):
        write(store, framer, record(framer, framer.node_id))
    parsed = parse_accusations(visible(store.get(KEY, now=time.time())))
    assert [(r.accuser, [a.accused for a in r.accusations]) for r in parsed] == [
        (accuser.node_id, ["a" * 40])
    ]


def test_parse_skips_entries_a_careless_replica_kept():
    """Read from a replica that ran no validator: an entry in the wrong subkey, or malformed,
    is not an accusation."""
    accuser, framer, garbled = NodeKey.generate(), NodeKey.generate(), NodeKey.generate()
    careless = RecordStore()
    now = time.time()
    entries = (
        (accuser, record(accuser, "a" * 40)),
        (framer, record(accuser, "b" * 40)),
        (garbled, {"accuser": garbled.node_id, "stage": 1, "accusations": "all of them", "updated": 0}),
    )
    for signer, value in entries:
        subkey = owned_subkey(signer.public_key)
        assert careless.put(KEY, subkey, make_record(KEY, subkey, value, now + 600, signer=signer), now=now)
    parsed = parse_accusations(visible(careless.get(KEY, now=now)))
    assert [(r.accuser, r.accusations[0].accused) for r in parsed] == [(accuser.node_id, "a" * 40)]
