"""The roles' shared contract: phases, stage roles, DHT entries parsed and validated by schema."""

from __future__ import annotations

import dataclasses
import time

import pytest

from agora_core.config import resolve_settings
from agora_core.contract import DepartureReason, Phase, StageRole
from agora_core.dht import DhtValue, RecordRejected, Validators
from agora_core.dht.records import make_record, owned_subkey
from agora_core.dht.storage import RecordStore
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.schema import (
    MAX_RECEIPTS,
    TrainerProgress,
    WorkerAnnouncement,
    WorkerDeparture,
    parse_entries,
    register_validators,
    stage_departures_key,
)


def announcement(**changes) -> dict:
    value = WorkerAnnouncement(
        node_id="n1",
        address="tcp://127.0.0.1:5000",
        stage=1,
        phase=Phase.SERVING,
        throughput=2.0,
        load=0,
        max_batch=8,
        version="0.1.0",
    ).to_value()
    return {**value, **changes}


def entries(*values) -> dict[str, DhtValue]:
    return {f"@{i}": DhtValue(value, time.time() + 60, None) for i, value in enumerate(values)}


def test_stage_roles_follow_the_position_in_the_pipeline():
    assert [StageRole.of(s, 4) for s in range(4)] == ["head", "body", "body", "tail"]
    assert [StageRole.of(s, 2) for s in range(2)] == [StageRole.HEAD, StageRole.TAIL]
    with pytest.raises(ValueError, match="does not exist"):
        StageRole.of(4, 4)


def test_phases_say_who_is_routed_to_and_whose_samples_count():
    assert [p for p in Phase if p.visible_to_trainers] == [Phase.SERVING, Phase.OPTIMIZER_SYNC]
    assert [p for p in Phase if p.counts_samples] == [Phase.SERVING]


def test_an_announcement_round_trips_with_its_phase_typed():
    parsed = WorkerAnnouncement.from_value(announcement(phase="weight_sync"))
    assert parsed.phase is Phase.WEIGHT_SYNC and not parsed.phase.visible_to_trainers
    with pytest.raises(RecordRejected, match="phase must be one of"):
        WorkerAnnouncement.from_value(announcement(phase="resting"))


def test_parse_entries_skips_malformed_entries_and_keeps_the_rest():
    found = entries(announcement(node_id="a"), {"node_id": 3}, "not a map", announcement(node_id="b"))
    parsed = parse_entries(found, WorkerAnnouncement.from_value)
    assert [a.node_id for a in parsed] == ["a", "b"]


def test_parse_entries_lets_a_bug_in_the_parser_propagate():
    def broken(_value):
        raise KeyError("a bug, not a malformed entry")

    with pytest.raises(KeyError):
        parse_entries(entries(announcement()), broken)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RoleSettings:
    phase: Phase = Phase.SERVING
    device: str = "auto"
    lanes: int = 8


def test_role_settings_take_flags_over_their_role_variables_over_defaults():
    env = {
        "AGORA_WORKER_DEVICE": "cpu",
        "AGORA_WORKER_PHASE": "optimizer_sync",
        "AGORA_WORKER_LANES": "3",
        "AGORA_TRAINER_LANES": "99",  # another role's: not this one's
        "AGORA_DEVICE": "cuda",  # no role: not a role setting
    }
    settings = resolve_settings(
        RoleSettings, {"lanes": 5, "device": None}, prefix="AGORA_WORKER_", environ=env
    )
    assert settings == RoleSettings(phase=Phase.OPTIMIZER_SYNC, device="cpu", lanes=5)
    assert settings.phase is Phase.OPTIMIZER_SYNC
    assert resolve_settings(RoleSettings, prefix="AGORA_TRAINER_", environ=env).lanes == 99
    with pytest.raises(ConfigError) as info:
        resolve_settings(RoleSettings, prefix="AGORA_WORKER_", environ={"AGORA_WORKER_PHASE": "resting"})
    assert info.value.key == "AGORA_WORKER_PHASE" and "weight_sync" in info.value.reason


def departure(key: NodeKey, **changes) -> dict:
    value = WorkerDeparture(
        node_id=key.node_id,
        stage=1,
        reason=DepartureReason.AVERAGING_FAILURES,
        value=2,
        threshold=2,
        unit="rounds",
        step=40,
        time=time.time(),
        exit_code=15,
        detail="2 of the last 3 averaging rounds failed",
    ).to_value()
    return {**value, **changes}


def test_a_departure_round_trips_and_malformed_ones_are_refused():
    key = NodeKey.generate()
    parsed = WorkerDeparture.from_value(departure(key))
    assert parsed.reason is DepartureReason.AVERAGING_FAILURES and parsed.value == 2.0
    for changes, message in [
        ({"reason": "bored"}, "reason must be one of"),
        ({"exit_code": 0}, "exit_code must lie"),
        ({"step": -1}, "non-negative"),
        ({"value": "2"}, "'value'"),
        ({"detail": "x" * 2000}, "'detail'"),
    ]:
        with pytest.raises(RecordRejected, match=message):
            WorkerDeparture.from_value(departure(key, **changes))


def test_only_the_departing_worker_may_publish_its_departure():
    validators = Validators()
    register_validators(validators, "run")
    store = RecordStore(validators=validators)
    key_name = stage_departures_key("run", 1)
    worker, other = NodeKey.generate(), NodeKey.generate()
    now = time.time()

    def write(signer: NodeKey, value: dict) -> bool:
        subkey = owned_subkey(signer.public_key)
        record = make_record(key_name, subkey, value, now + 600, signer=signer)
        store.validate(key_name, subkey, record, now=now)
        return store.put(key_name, subkey, record, now=now)

    assert write(worker, departure(worker))
    with pytest.raises(RecordRejected, match="departing worker's own subkey"):
        write(other, departure(worker))  # another node cannot claim the worker left
    with pytest.raises(RecordRejected, match="reason"):
        write(worker, departure(worker, reason="bored"))


def test_a_trainer_report_carries_its_receipts_and_refuses_ones_it_could_not_have_given():
    report = TrainerProgress(
        node_id="t", loss_ema=3.0, loss_last=2.9, samples=40, tokens=640, lanes=2, receipts={"a": 40, "b": 12}
    )
    assert TrainerProgress.from_value(report.to_value()) == report
    older = {k: v for k, v in report.to_value().items() if k != "receipts"}  # a report without any
    assert TrainerProgress.from_value(older).receipts == {}
    for receipts, why in (
        ({"a": 41}, "between 0 and"),  # more than it completed
        ({"a": -1}, "between 0 and"),
        ({"a": True}, "between 0 and"),
        ({"": 1}, "node id"),
        ({f"w{i}": 0 for i in range(MAX_RECEIPTS + 1)}, "at most"),
    ):
        with pytest.raises(RecordRejected, match=why):
            TrainerProgress.from_value({**report.to_value(), "receipts": receipts})
