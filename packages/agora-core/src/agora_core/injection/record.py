"""An injection record: a failure the operator orders, which nodes suffer it, and when.

Records live in the run's DHT under :func:`injections_key`, one subkey per record owned by
the operator key that wrote it (``@<hex key>/<record id>``, so only that key can write or
delete it), and expire with the record (``expires``): a stale record vanishes from the DHT by
itself. A record is a msgpack map:

``{v: 1, id, issued, expires, trigger, action, targets: {nodes, stage, role, fraction,
joiners}, after_s, at_chunk, factor, duration_s, exit_code, credential}``

Nodes parse it strictly (:meth:`Injection.from_value`): anything malformed, of another
version, or naming a trigger or action this node does not know raises
:class:`InjectionRejected` with a low-cardinality reason, and the node ignores it.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any

VERSION = 1
ID_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
NODE_ID_PREFIX = re.compile(r"[0-9a-f]{8,40}")  # a node id (40 hex digits) or a prefix of 8 or more
MAX_NODES = 256
MAX_SECONDS = 86_400.0  # delays and durations: a day at most
INJECTED_EXIT_CODE = 99  # what an injected crash exits with unless the record says otherwise
ROLES = ("worker", "trainer")


class InjectionRejected(Exception):
    """A record this node will not obey; ``reason`` labels the ignored-records counter."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


class Trigger(enum.StrEnum):
    """When an injection fires on a node it selects."""

    NOW = "now"  # as soon as the node reads the record
    AFTER = "after"  # ``after_s`` seconds after the record was issued
    AVERAGING_SEND = "averaging_send"  # as the node streams averaging chunk ``at_chunk`` of a slice
    FORWARD = "forward"  # worker: a forward computed, not yet answered; trainer: at a forward hop
    BACKWARD = "backward"  # worker: a backward computed, not yet answered; trainer: a backward hop
    DOWNLOAD = "download"  # a joiner's state download, once ``at_chunk`` pieces arrived

    @property
    def timed(self) -> bool:
        """Fired by the clock, not by the code reaching a point."""
        return self in (Trigger.NOW, Trigger.AFTER)


class Action(enum.StrEnum):
    """What the node does when the injection fires."""

    EXIT = "exit"  # os._exit at once: no LEFT, no withdrawal, no flush of anything (a crash)
    HANG = "hang"  # block its event loop: alive, answering nothing (``duration_s``; 0: for good)
    SLOW = "slow"  # compute takes ``factor`` times as long, for ``duration_s``
    DROP_LINK = "drop_link"  # nothing in or out over RPC for ``duration_s``
    NAN = "nan"  # its next outgoing gradient is NaN (the receiving worker's input check refuses it)


def injections_key(run_name: str) -> str:
    """Where the operator's injection records of run ``run_name`` live."""
    return f"{run_name}/operator/injections"


def record_subkey(public_key: bytes, record_id: str) -> str:
    """The subkey of record ``record_id`` written by ``public_key`` (owned: only it may write)."""
    return f"@{public_key.hex()}/{record_id}"


def selected_by_fraction(record_id: str, node_id: str, fraction: float) -> bool:
    """Whether ``node_id`` is in the ``fraction`` of nodes record ``record_id`` picks: a hash of
    both, so every node decides alone and about ``fraction`` of them say yes."""
    digest = hashlib.blake2b(f"{record_id}/{node_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < fraction


@dataclass(frozen=True, kw_only=True)
class NodeTraits:
    """What targets are matched against: the node reading the record."""

    node_id: str
    role: str  # worker or trainer
    stage: int | None  # a worker's; None for a trainer
    started: float  # wall-clock seconds when it began reading records


@dataclass(frozen=True, kw_only=True)
class Targets:
    """Which nodes a record selects: every given criterion must hold (none given: every node)."""

    nodes: tuple[str, ...] = ()  # node ids, or prefixes of 8+ hex digits
    stage: int | None = None
    role: str | None = None  # worker or trainer
    fraction: float | None = None  # of the nodes the other criteria select, by hash
    # Nodes that started after the record was issued obey it only if true: a record about the
    # nodes of now must not fire on their replacements (a download trigger is about joiners).
    joiners: bool = False

    def selects(self, record_id: str, issued: float, node: NodeTraits) -> bool:
        if self.nodes and not any(node.node_id.startswith(prefix) for prefix in self.nodes):
            return False
        if self.stage is not None and node.stage != self.stage:
            return False
        if self.role is not None and node.role != self.role:
            return False
        if self.fraction is not None and not selected_by_fraction(record_id, node.node_id, self.fraction):
            return False
        return self.joiners or node.started <= issued

    def to_value(self) -> dict:
        return {
            "nodes": list(self.nodes),
            "stage": self.stage,
            "role": self.role,
            "fraction": self.fraction,
            "joiners": self.joiners,
        }

    @classmethod
    def from_value(cls, value: Any) -> Targets:
        if not isinstance(value, dict):
            raise InjectionRejected("malformed", "targets must be a map")
        nodes = value.get("nodes", [])
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise InjectionRejected("malformed", f"targets.nodes must be a list of at most {MAX_NODES}")
        for node in nodes:
            if not isinstance(node, str) or not NODE_ID_PREFIX.fullmatch(node):
                raise InjectionRejected("malformed", "targets.nodes holds node ids (8 to 40 hex digits)")
        stage = _optional(value, "stage", int)
        if stage is not None and stage < 0:
            raise InjectionRejected("malformed", "targets.stage must be >= 0")
        role = _optional(value, "role", str)
        if role is not None and role not in ROLES:
            raise InjectionRejected("malformed", f"targets.role must be one of {ROLES}")
        fraction = _optional(value, "fraction", (int, float))
        if fraction is not None and not 0 < fraction <= 1:
            raise InjectionRejected("malformed", "targets.fraction must lie in (0, 1]")
        joiners = value.get("joiners", False)
        if not isinstance(joiners, bool):
            raise InjectionRejected("malformed", "targets.joiners must be a bool")
        return cls(
            nodes=tuple(nodes),
            stage=stage,
            role=role,
            fraction=None if fraction is None else float(fraction),
            joiners=joiners,
        )


@dataclass(frozen=True, kw_only=True)
class Injection:
    id: str
    issued: float  # wall-clock seconds, the operator's clock
    expires: float  # the DHT record's expiration too
    trigger: Trigger
    action: Action
    targets: Targets = field(default_factory=Targets)
    after_s: float = 0.0  # Trigger.AFTER: seconds after ``issued``
    at_chunk: int = 1  # AVERAGING_SEND / DOWNLOAD: chunks (pieces) done first; 1 makes it "mid"
    factor: float = 1.0  # Action.SLOW: compute time multiplied by this
    duration_s: float = 0.0  # SLOW and DROP_LINK: how long; HANG: how long (0: until killed)
    exit_code: int = INJECTED_EXIT_CODE  # Action.EXIT
    credential: Any = None  # an authorized run: the writer's operator credential (a signed map)

    def __post_init__(self) -> None:
        object.__setattr__(self, "trigger", Trigger(self.trigger))
        object.__setattr__(self, "action", Action(self.action))
        self.check()

    def check(self) -> None:
        """InjectionRejected("malformed", ...) unless every field is in range for its action."""

        def bad(message: str) -> InjectionRejected:
            return InjectionRejected("malformed", message)

        if not ID_PATTERN.fullmatch(self.id):
            raise bad("id must be 1-64 characters of A-Z a-z 0-9 . _ -")
        if not (math.isfinite(self.issued) and math.isfinite(self.expires)) or self.expires <= self.issued:
            raise bad("issued and expires must be finite, expires after issued")
        for name in ("after_s", "duration_s"):
            if not 0 <= getattr(self, name) <= MAX_SECONDS:
                raise bad(f"{name} must lie in [0, {MAX_SECONDS:g}]")
        if not 0 <= self.at_chunk <= 1_000_000:
            raise bad("at_chunk must lie in [0, 1000000]")
        if self.action is Action.SLOW and not (1 < self.factor <= 1000 and self.duration_s > 0):
            raise bad("slow needs a factor in (1, 1000] and duration_s > 0")
        if self.action is Action.DROP_LINK and self.duration_s <= 0:
            raise bad("drop_link needs duration_s > 0")
        if not 1 <= self.exit_code <= 255:
            raise bad("exit_code must lie in [1, 255]")

    def fires_at(self) -> float:
        """Wall-clock time a timed trigger is due."""
        return self.issued + (self.after_s if self.trigger is Trigger.AFTER else 0.0)

    def to_value(self) -> dict:
        return {
            "v": VERSION,
            "id": self.id,
            "issued": self.issued,
            "expires": self.expires,
            "trigger": self.trigger.value,
            "action": self.action.value,
            "targets": self.targets.to_value(),
            "after_s": self.after_s,
            "at_chunk": self.at_chunk,
            "factor": self.factor,
            "duration_s": self.duration_s,
            "exit_code": self.exit_code,
            "credential": self.credential,
        }

    @classmethod
    def from_value(cls, value: Any) -> Injection:
        """Parse a record strictly; InjectionRejected (malformed, version, unknown_trigger,
        unknown_action) for anything this node will not obey."""
        if not isinstance(value, dict):
            raise InjectionRejected("malformed", "an injection record is a map")
        if value.get("v") != VERSION:
            raise InjectionRejected("version", f"injection record version {value.get('v')!r}, not {VERSION}")
        try:
            trigger = Trigger(value.get("trigger"))
        except ValueError:
            raise InjectionRejected("unknown_trigger", f"unknown trigger {value.get('trigger')!r}") from None
        try:
            action = Action(value.get("action"))
        except ValueError:
            raise InjectionRejected("unknown_action", f"unknown action {value.get('action')!r}") from None
        numbers = {name: _optional(value, name, (int, float)) for name in ("after_s", "factor", "duration_s")}
        integers = {name: _optional(value, name, int) for name in ("at_chunk", "exit_code")}
        record_id, issued, expires = value.get("id"), value.get("issued"), value.get("expires")
        if not isinstance(record_id, str):
            raise InjectionRejected("malformed", "id must be a string")
        for name, number in (("issued", issued), ("expires", expires)):
            if isinstance(number, bool) or not isinstance(number, (int, float)):
                raise InjectionRejected("malformed", f"{name} must be a number")
        return cls(
            id=record_id,
            issued=float(issued),
            expires=float(expires),
            trigger=trigger,
            action=action,
            targets=Targets.from_value(value.get("targets", {})),
            credential=value.get("credential"),
            **{name: float(number) for name, number in numbers.items() if number is not None},
            **{name: number for name, number in integers.items() if number is not None},
        )

    def describe(self) -> str:
        """One line for humans (``inject.py list``, log lines)."""
        targets = self.targets
        parts = [f"{self.action}" + (f" x{self.factor:g}" if self.action is Action.SLOW else "")]
        if self.duration_s and self.action in (Action.SLOW, Action.DROP_LINK, Action.HANG):
            parts.append(f"for {self.duration_s:g} s")
        parts.append(
            f"at {self.trigger}" + (f" +{self.after_s:g} s" if self.trigger is Trigger.AFTER else "")
        )
        chosen = []
        if targets.nodes:
            chosen.append("nodes " + ",".join(n[:12] for n in targets.nodes))
        if targets.role:
            chosen.append(f"{targets.role}s")
        if targets.stage is not None:
            chosen.append(f"stage {targets.stage}")
        if targets.fraction is not None:
            chosen.append(f"{targets.fraction:.0%} of them")
        parts.append("on " + (" ".join(chosen) if chosen else "every node"))
        if targets.joiners:
            parts.append("(joiners too)")
        return " ".join(parts)


def _optional(value: dict, name: str, kind: type | tuple[type, ...]) -> Any:
    item = value.get(name)
    if item is None:
        return None
    if isinstance(item, bool) or not isinstance(item, kind):
        raise InjectionRejected("malformed", f"field {name!r} has the wrong type ({type(item).__name__})")
    if isinstance(item, float) and not math.isfinite(item):
        raise InjectionRejected("malformed", f"field {name!r} must be finite")
    return item
