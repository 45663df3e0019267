"""What the roles of a run tell each other through the DHT: key names and value schemas.

Workers announce themselves and their stage's progress, and say why when they terminate
themselves; trainers read the announcements to route work and report their own progress.
Every role imports this module (trainers without torch), and every DHT node can enforce the
schemas on receive with :func:`register_validators`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from agora_core.admission.accusations import accusations_key, check_accusations
from agora_core.admission.revocations import check_revocations, revocations_key
from agora_core.contract import DepartureReason, Phase
from agora_core.dht import DhtValue
from agora_core.dht.records import RecordRejected, subkey_owner
from agora_core.dht.storage import Validators
from agora_core.identity import node_id_from_public_key

T = TypeVar("T")


def stage_workers_key(run_name: str, stage: int) -> str:
    """Where the workers of ``stage`` announce themselves (one owned subkey each)."""
    return f"{run_name}/stage/{stage}/workers"


def stage_progress_key(run_name: str, stage: int) -> str:
    """Where the workers of ``stage`` publish how many samples they accumulated this step."""
    return f"{run_name}/stage/{stage}/progress"


def averaging_round_key(run_name: str, stage: int, round_index: int) -> str:
    """Where the peers of ``stage`` meet for averaging round ``round_index`` (matchmaking)."""
    return f"{run_name}/stage/{stage}/averaging/{round_index}"


def averaging_summary_key(run_name: str, stage: int) -> str:
    """Where the workers of ``stage`` publish their latest averaging round's report."""
    return f"{run_name}/stage/{stage}/averaging/summary"


def stage_departures_key(run_name: str, stage: int) -> str:
    """Where workers of ``stage`` that terminated themselves say why (one owned subkey each)."""
    return f"{run_name}/stage/{stage}/departures"


def trainer_progress_key(run_name: str) -> str:
    """Where trainers report their progress (one owned subkey each)."""
    return f"{run_name}/trainers"


def parse_entries(values: Mapping[str, DhtValue], parse: Callable[[Any], T]) -> list[T]:
    """Every entry under a key that ``parse`` (a schema's ``from_value``) accepts.

    A malformed entry (``RecordRejected``) is skipped: validators on the storing nodes should
    have refused it, and one bad writer must not hide the others. Any other error is a bug and
    propagates.
    """
    parsed = []
    for value in values.values():
        try:
            parsed.append(parse(value.value))
        except RecordRejected:
            continue
    return parsed


NUMBER = (int, float)  # a field kind: any number, read as a float


def _field(value: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    item = value.get(name)
    if isinstance(item, bool) or not isinstance(item, kind):
        raise RecordRejected(f"field {name!r} has the wrong type ({type(item).__name__})")
    return float(item) if kind is NUMBER else item


def _fields(value: Any, what: str, kinds: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The fields ``kinds`` names, each of its kind; RecordRejected when ``value`` is not a map
    holding them."""
    if not isinstance(value, dict):
        raise RecordRejected(f"{what} must be a map")
    return {name: _field(value, name, kind) for name, kind in kinds.items()}


def _optional(value: dict, name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """A field that may be absent (or nil): ``default`` then."""
    return default if value.get(name) is None else _field(value, name, kind)


def _phase(value: dict) -> Phase:
    try:
        return Phase(_field(value, "phase", str))
    except ValueError:
        raise RecordRejected(f"phase must be one of {[p.value for p in Phase]}") from None


@dataclass(frozen=True, kw_only=True)
class WorkerAnnouncement:
    """A worker's entry under :func:`stage_workers_key`: it lives the run's dht.record_ttl_s,
    refreshed every announce_interval_s (at most a third of it)."""

    node_id: str
    address: str
    stage: int
    phase: Phase
    throughput: float  # samples per second it measured serving
    load: int  # samples waiting in its queues
    max_batch: int  # samples it merges into one microbatch at most
    version: str  # agora-worker version

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))  # a phase given by name

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> WorkerAnnouncement:
        kinds = {"node_id": str, "address": str, "stage": int, "throughput": NUMBER, "load": int}
        fields = _fields(value, "a worker announcement", {**kinds, "max_batch": int, "version": str})
        announcement = cls(phase=_phase(value), **fields)
        if announcement.stage < 0 or announcement.max_batch < 1 or announcement.load < 0:
            raise RecordRejected("stage, max_batch and load must be non-negative (max_batch >= 1)")
        return announcement


@dataclass(frozen=True, kw_only=True)
class StageProgress:
    """A worker's entry under :func:`stage_progress_key`: its step and samples toward it."""

    node_id: str
    step: int
    samples: int
    address: str = ""  # where to poke the worker when a peer steps ("" in older reports)

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> StageProgress:
        fields = _fields(value, "a stage progress report", {"node_id": str, "step": int, "samples": int})
        progress = cls(address=_optional(value, "address", str, ""), **fields)
        if progress.step < 0 or progress.samples < 0:
            raise RecordRejected("step and samples must be non-negative")
        return progress


MAX_RECEIPTS = 512  # workers one trainer report gives receipts for


@dataclass(frozen=True, kw_only=True)
class TrainerProgress:
    """A trainer's entry under :func:`trainer_progress_key`, signed by the trainer (its own
    subkey). ``receipts`` are what it vouches for: per worker, the samples of the microbatches
    it completed that the worker computed (its forward and backward at one stage), since the
    trainer started; the monitor credits workers from these, not from what they report."""

    node_id: str
    loss_ema: float | None  # None until the first sample completes
    loss_last: float | None
    samples: int  # completed, since the trainer started
    tokens: int
    lanes: int
    receipts: dict[str, int] = field(default_factory=dict)  # worker node id -> samples

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> TrainerProgress:
        kinds = {"node_id": str, "samples": int, "tokens": int, "lanes": int}
        fields = _fields(value, "a trainer progress report", kinds)
        losses = {name: _optional(value, name, NUMBER, None) for name in ("loss_ema", "loss_last")}
        receipts = _optional(value, "receipts", dict, {})
        progress = cls(**fields, **losses, receipts=receipts)
        if progress.samples < 0 or progress.tokens < 0 or progress.lanes < 0:
            raise RecordRejected("samples, tokens and lanes must be non-negative")
        if len(receipts) > MAX_RECEIPTS:
            raise RecordRejected(f"a trainer report holds receipts for at most {MAX_RECEIPTS} workers")
        for worker, samples in receipts.items():
            if not isinstance(worker, str) or not 0 < len(worker) <= 64:
                raise RecordRejected("a receipt names a worker by its node id")
            if (
                isinstance(samples, bool)
                or not isinstance(samples, int)
                or not 0 <= samples <= progress.samples
            ):
                raise RecordRejected(
                    "a receipt's samples are an int between 0 and the trainer's completed samples"
                )
        return progress


@dataclass(frozen=True, kw_only=True)
class WorkerDeparture:
    """A worker's entry under :func:`stage_departures_key`: the rule that made it terminate."""

    node_id: str
    stage: int
    reason: DepartureReason
    value: float  # what the rule measured ...
    threshold: float  # ... and the threshold it passed
    unit: str  # of value and threshold: "requests", "steps", "s", "MiB", "rounds"
    step: int  # the worker's optimizer step when it left
    time: float  # wall-clock seconds
    exit_code: int  # what its process exits with
    detail: str = ""  # a sentence for humans

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", DepartureReason(self.reason))  # a reason given by name

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> WorkerDeparture:
        kinds = {"node_id": str, "stage": int, "reason": str, "value": NUMBER, "threshold": NUMBER}
        kinds |= {"unit": str, "step": int, "time": NUMBER, "exit_code": int}
        fields = _fields(value, "a worker departure", kinds)
        try:
            fields["reason"] = DepartureReason(fields["reason"])
        except ValueError:
            raise RecordRejected(f"reason must be one of {[r.value for r in DepartureReason]}") from None
        detail = _optional(value, "detail", str, "")
        if len(detail) > 1024:
            raise RecordRejected("field 'detail' must be a string of at most 1024 characters")
        departure = cls(detail=detail, **fields)
        if departure.stage < 0 or departure.step < 0:
            raise RecordRejected("stage and step must be non-negative")
        if not 0 < departure.exit_code < 256:
            raise RecordRejected(f"exit_code must lie in [1, 255], got {departure.exit_code}")
        return departure


def _check_departure(subkey: str, value: Any) -> None:
    """Only the departing worker may say it departed: its own owned subkey, its own node id."""
    departure = WorkerDeparture.from_value(value)
    owner = subkey_owner(subkey)
    if owner is None or node_id_from_public_key(owner) != departure.node_id:
        raise RecordRejected("a departure must be written under the departing worker's own subkey")


def register_validators(
    validators: Validators, run_name: str, authorizer_public_key: bytes | None = None
) -> None:
    """Make a DHT node refuse malformed announcements, progress reports and departure records
    of run ``run_name``, accusations not in their accuser's own subkey, and any revocation list
    not written by its authorizer (none at all in an open run, which has no authorizer)."""

    def check(key: str, subkey: str, value: Any) -> None:
        if key.endswith("/workers"):
            WorkerAnnouncement.from_value(value)
        elif key.endswith("/progress"):
            StageProgress.from_value(value)
        elif key.endswith("/departures"):
            _check_departure(subkey, value)

    validators.register(f"{run_name}/stage/", check)
    validators.register(
        trainer_progress_key(run_name), lambda key, subkey, value: TrainerProgress.from_value(value)
    )
    validators.register(revocations_key(run_name), check_revocations(authorizer_public_key))
    validators.register(accusations_key(run_name), check_accusations)
