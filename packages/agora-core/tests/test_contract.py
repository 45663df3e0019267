"""The roles' shared contract: phases, stage roles, DHT entries parsed by schema."""

from __future__ import annotations

import dataclasses
import time

import pytest

from agora_core.config import resolve_settings
from agora_core.contract import Phase, StageRole
from agora_core.dht import DhtValue, RecordRejected
from agora_core.errors import ConfigError
from agora_core.schema import WorkerAnnouncement, parse_entries


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
