"""Accusations: what a node saw another do wrong, signed and published for the authorizer.

Two detectors write accusations under ``<run>/accusations``, each in the subkey its own key
owns, so every entry is signed by its accuser and nobody can accuse in another's name
(:func:`check_accusations` is the validator every replica runs on it):

* an averaging peer that kept clipping another's contributions (``WORKER_KINDS``); its
  evidence is :class:`Evidence`: the rounds it saw, and for each the distance and radius it
  measured, for anyone who holds the same parameters to hold against their own;
* a trainer whose spot checks caught a worker's output standing apart from two other
  replicas that agreed (``TRAINER_KINDS``); its evidence is :class:`CheckEvidence`.

One entry per accuser holds all its current accusations (at most ``MAX_ACCUSED``).
An accusation alone bans nobody: the authorizer counts *independent* accusers (distinct
accounts holding live credentials, a worker only on the accused's stage) and revokes at the
run's ``admission.revoke_after_accusers``, so a single liar cannot frame an honest node; a
trainer of one of the run's anchor accounts is the operator's own, and its checks may count
alone (``admission.revoke_on_anchor_spot_check``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agora_core.dht.records import RecordRejected, subkey_owner
from agora_core.identity import node_id_from_public_key

MAX_ACCUSED = 64  # accusations in one accuser's entry
MAX_EVIDENCE = 16  # evidence items in one accusation
WORKER_KINDS = ("averaging_values", "averaging_reducer", "averaging_weight")
TRAINER_KINDS = ("compute_output",)  # a spot check's verdict (agora_trainer.spotcheck)
KINDS = WORKER_KINDS + TRAINER_KINDS


def accusations_key(run_name: str) -> str:
    return f"{run_name}/accusations"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Evidence:
    """One clipped contribution: in ``round``, on ``slice`` (chunk ``chunk``), the accused
    stood ``measured`` from the accuser's copy where ``radius`` was the most it could."""

    round: int
    slice: int
    chunk: int
    measured: float
    radius: float

    def to_value(self) -> list:
        return [self.round, self.slice, self.chunk, self.measured, self.radius]

    @classmethod
    def from_value(cls, value: Any) -> Evidence:
        if not isinstance(value, list) or len(value) != 5:
            raise RecordRejected("evidence is [round, slice, chunk, measured, radius]")
        round_, slice_, chunk, measured, radius = value
        if not (_count(round_) and _count(slice_) and isinstance(chunk, int) and chunk >= -1):
            raise RecordRejected("evidence round, slice and chunk must be ints >= 0 (chunk -1: a weight)")
        if not (_number(measured) and _number(radius) and measured >= 0 and radius >= 0):
            raise RecordRejected("evidence measured and radius must be finite numbers >= 0")
        return cls(round_, slice_, chunk, float(measured), float(radius))


@dataclass(frozen=True)
class CheckEvidence:
    """One spot check the accused failed: the trainer's check number ``check`` on ``stage``;
    the accused's output stood ``measured`` (relative distance) from the nearer of two other
    replicas' outputs, which stood ``agreed`` from each other, where ``tolerance`` was the
    most two honest replicas' outputs stand apart."""

    check: int
    stage: int
    measured: float
    agreed: float
    tolerance: float

    def to_value(self) -> list:
        return [self.check, self.stage, self.measured, self.agreed, self.tolerance]

    @classmethod
    def from_value(cls, value: Any) -> CheckEvidence:
        if not isinstance(value, list) or len(value) != 5:
            raise RecordRejected("check evidence is [check, stage, measured, agreed, tolerance]")
        check, stage, measured, agreed, tolerance = value
        if not (_count(check) and _count(stage)):
            raise RecordRejected("check evidence check and stage must be ints >= 0")
        if not all(_number(v) and v >= 0 for v in (measured, agreed, tolerance)):
            raise RecordRejected("check evidence distances must be finite numbers >= 0")
        if not agreed <= tolerance < measured:
            raise RecordRejected("check evidence must show agreed <= tolerance < measured")
        return cls(check, stage, float(measured), float(agreed), float(tolerance))


@dataclass(frozen=True)
class Accusation:
    accused: str  # node id
    kind: str  # one of KINDS
    rounds: int  # distinct rounds (failed checks, for a trainer's) the accuser saw it in
    at: float  # wall-clock seconds of the newest of them
    evidence: tuple[Evidence | CheckEvidence, ...] = field(default=())  # the worst few, newest first

    def to_value(self) -> dict:
        return {
            "accused": self.accused,
            "kind": self.kind,
            "rounds": self.rounds,
            "at": self.at,
            "evidence": [e.to_value() for e in self.evidence],
        }

    @classmethod
    def from_value(cls, value: Any) -> Accusation:
        if not isinstance(value, dict):
            raise RecordRejected("an accusation must be a map")
        accused, kind, rounds, at = (value.get(k) for k in ("accused", "kind", "rounds", "at"))
        if not isinstance(accused, str) or not 0 < len(accused) <= 64:
            raise RecordRejected("accusation.accused must be a node id")
        if kind not in KINDS:
            raise RecordRejected(f"accusation.kind must be one of {list(KINDS)}")
        if not _count(rounds) or rounds < 1:
            raise RecordRejected("accusation.rounds must be an int >= 1")
        if not _number(at):
            raise RecordRejected("accusation.at must be a finite number")
        evidence = value.get("evidence", [])
        if not isinstance(evidence, list) or len(evidence) > MAX_EVIDENCE:
            raise RecordRejected(f"accusation.evidence must be a list of at most {MAX_EVIDENCE}")
        parse = CheckEvidence.from_value if kind in TRAINER_KINDS else Evidence.from_value
        return cls(accused, kind, rounds, float(at), tuple(parse(e) for e in evidence))


@dataclass(frozen=True)
class AccuserRecord:
    """One accuser's entry: its node id, stage (None: a trainer's), and what it accuses."""

    accuser: str
    stage: int | None
    accusations: tuple[Accusation, ...]
    updated: float

    def to_value(self) -> dict:
        return {
            "accuser": self.accuser,
            "stage": self.stage,
            "accusations": [a.to_value() for a in self.accusations],
            "updated": self.updated,
        }

    @classmethod
    def from_value(cls, value: Any) -> AccuserRecord:
        if not isinstance(value, dict):
            raise RecordRejected("an accuser's entry must be a map")
        accuser, stage, items, updated = (
            value.get(k) for k in ("accuser", "stage", "accusations", "updated")
        )
        if not isinstance(accuser, str) or not accuser:
            raise RecordRejected("accusations.accuser must be a node id")
        if stage is not None and not _count(stage):
            raise RecordRejected("accusations.stage must be an int >= 0, or nil for a trainer")
        if not isinstance(items, list) or len(items) > MAX_ACCUSED:
            raise RecordRejected(f"accusations.accusations must be a list of at most {MAX_ACCUSED}")
        if not _number(updated):
            raise RecordRejected("accusations.updated must be a finite number")
        accusations = tuple(Accusation.from_value(item) for item in items)
        if any(a.accused == accuser for a in accusations):
            raise RecordRejected("a node cannot accuse itself")
        mine = TRAINER_KINDS if stage is None else WORKER_KINDS
        if any(a.kind not in mine for a in accusations):
            raise RecordRejected(
                f"an entry {'without' if stage is None else 'with'} a stage accuses of {list(mine)} only"
            )
        return cls(accuser, stage, accusations, float(updated))


def _owned_by_accuser(subkey: str, record: AccuserRecord) -> bool:
    owner = subkey_owner(subkey)
    return owner is not None and node_id_from_public_key(owner) == record.accuser


def check_accusations(key: str, subkey: str, value: Any) -> None:
    """The DHT validator of the accusations key: a node accuses only in its own name."""
    if value is None:
        return
    if not _owned_by_accuser(subkey, AccuserRecord.from_value(value)):
        raise RecordRejected("accusations must be written under the accuser's own subkey")


def parse_accusations(values: Mapping[str, Any]) -> list[AccuserRecord]:
    """The well-formed entries among those read under ``<run>/accusations``, each in its
    accuser's own subkey (a replica that skipped the validator cannot forge one)."""
    records = []
    for subkey, entry in values.items():
        try:
            record = AccuserRecord.from_value(entry.value)
        except RecordRejected:
            continue
        if (
            entry.owner is not None
            and entry.owner == subkey_owner(subkey)
            and _owned_by_accuser(subkey, record)
        ):
            records.append(record)
    return records
