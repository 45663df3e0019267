"""The operator's shard assignment: which shards each trainer of a run reads, signed.

``tools/rotate_shards.py`` writes it under ``<run>/operator/shards``, in the writer's own
subkey for the record id, and every trainer reads it (``rotation.ShardRotation``) and obeys
the newest one an operator signed (the same check as failure injection's:
``agora_core.injection.operators``). A record maps trainers (8+ hex digits of a node id) to
shard ranges (``"0-3,8,12-15"``, the manifest's shard ids) and may give the ranges of every
trainer it does not name (``others``); a trainer a record does not cover reads what its own
``--shard-ranges`` say (all shards without them). Shards new to a trainer open no sooner
than ``handover_s`` after the record was issued, so the trainer they come from has read it
and published what it holds by then.

A record lives at most what the DHT's replicas accept (``dht.max_expiration_ahead_s`` less
``dht.max_clock_skew_s``: about 58 minutes by default), but an assignment is a standing order: a
trainer keeps the last one it obeyed (in its state file, across restarts) until a newer one
says otherwise. ``clear`` is such a newer record, naming no trainer: back to --shard-ranges.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from agora_core import world
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.injection.publish import retrying
from agora_core.injection.record import record_subkey
from agora_trainer.errors import DataError

DEFAULT_HANDOVER_S = 10.0  # a few of the trainers' progress intervals (2 s by default)


class RotationError(DataError):
    """A shard assignment or a range of shards that cannot be read as given."""


def shard_assignment_key(run_name: str) -> str:
    return f"{run_name}/operator/shards"


def parse_ranges(text: str) -> frozenset[int]:
    """``"0-3,8, 12-13"`` -> {0, 1, 2, 3, 8, 12, 13}; ``""`` -> nothing. RotationError if malformed."""
    ids: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        low, _, high = part.partition("-")
        try:
            first, last = int(low), int(high or low)
        except ValueError:
            raise RotationError(f"shard range {part!r}: expected N or N-M (shard ids)") from None
        if first < 0 or last < first:
            raise RotationError(f"shard range {part!r}: expected 0 <= N <= M")
        if last - first >= 1_000_000:
            raise RotationError(f"shard range {part!r} is implausibly large")
        ids.update(range(first, last + 1))
    return frozenset(ids)


def format_ranges(ids: Iterable[int]) -> str:
    """The shortest ranges text of ``ids``: {0, 1, 2, 5} -> ``"0-2,5"``."""
    ordered, parts = sorted(set(ids)), []
    start = None
    for i, value in enumerate(ordered):
        if start is None:
            start = value
        if i + 1 == len(ordered) or ordered[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ",".join(parts)


def node_prefix(text: str) -> str:
    prefix = text.strip().lower()
    if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
        raise RotationError(f"trainer {text!r}: expected 8 or more hex digits of its node id")
    return prefix


@dataclass(frozen=True)
class ShardAssignment:
    id: str
    issued: float
    expires: float
    trainers: dict[str, frozenset[int]] = field(default_factory=dict)  # node id prefix -> shard ids
    others: frozenset[int] | None = None  # every trainer not named (None: their own --shard-ranges)
    handover_s: float = DEFAULT_HANDOVER_S
    credential: Any = None  # an authorized run: the writer's operator credential

    def __post_init__(self) -> None:
        prefixes = sorted(self.trainers)
        for a, b in itertools.pairwise(prefixes):
            if b.startswith(a):
                raise RotationError(f"trainers {a} and {b}: one prefix names both")
        if self.handover_s < 0:
            raise RotationError("handover_s must be >= 0")
        named = list(self.trainers.items())
        for i, (a, ids_a) in enumerate(named):
            for b, ids_b in named[i + 1 :]:
                if ids_a & ids_b:
                    raise RotationError(
                        f"trainers {a} and {b} would both read shards {format_ranges(ids_a & ids_b)}"
                    )

    def for_trainer(self, node_id: str) -> frozenset[int] | None:
        """The shards this record gives ``node_id``, or None where it says nothing of it."""
        for prefix, ids in self.trainers.items():
            if node_id.startswith(prefix):
                return ids
        return self.others

    def describe(self) -> str:
        named = [f"{p[:12]}={format_ranges(ids) or '-'}" for p, ids in self.trainers.items()]
        if self.others is not None:
            named.append(f"others={format_ranges(self.others) or '-'}")
        return " ".join(named) or "(no trainer named)"

    def to_value(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "issued": self.issued,
            "expires": self.expires,
            "trainers": {p: format_ranges(ids) for p, ids in self.trainers.items()},
            "others": None if self.others is None else format_ranges(self.others),
            "handover_s": self.handover_s,
            "credential": self.credential,
        }

    @classmethod
    def from_value(cls, value: Any) -> ShardAssignment:
        """RotationError for anything but a well-formed record."""
        if not isinstance(value, dict) or not isinstance(value.get("trainers"), dict):
            raise RotationError("a shard assignment is a map with a trainers map")
        try:
            others = value.get("others")
            return cls(
                id=str(value["id"]),
                issued=float(value["issued"]),
                expires=float(value["expires"]),
                trainers={node_prefix(p): parse_ranges(str(r)) for p, r in value["trainers"].items()},
                others=None if others is None else parse_ranges(str(others)),
                handover_s=float(value.get("handover_s", DEFAULT_HANDOVER_S)),
                credential=value.get("credential"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RotationError(f"a shard assignment is malformed ({exc!r})") from None


def new_assignment(
    trainers: dict[str, frozenset[int]],
    *,
    others: frozenset[int] | None = None,
    handover_s: float = DEFAULT_HANDOVER_S,
    ttl_s: float = 3000.0,
    credential: Any = None,
) -> ShardAssignment:
    """A record issued now; ``ttl_s`` at most the run's longest-lived record (``longest_ttl_s``)."""
    issued = world.wall()
    return ShardAssignment(
        id=f"shards-{int(issued)}-{world.token_hex(3)}",
        issued=issued,
        expires=issued + ttl_s,
        trainers={node_prefix(p): ids for p, ids in trainers.items()},
        others=others,
        handover_s=handover_s,
        credential=credential,
    )


async def publish_assignment(dht: DhtNode, key: NodeKey, run_name: str, record: ShardAssignment) -> int:
    """Store ``record`` under ``key``'s own subkey for it; the replicas that took it."""
    subkey = record_subkey(key.public_key, record.id)
    key_name = shard_assignment_key(run_name)
    return await retrying(
        lambda: dht.store(key_name, subkey, record.to_value(), record.expires, signer=key), 10.0
    )


def longest_ttl_s(max_expiration_ahead_s: float, max_clock_skew_s: float) -> float:
    """The longest a record may live in a run whose DHT has these limits (replicas refuse more)."""
    return max(1.0, max_expiration_ahead_s - max_clock_skew_s - 60.0)


async def clear_assignments(
    dht: DhtNode, key: NodeKey, run_name: str, *, ttl_s: float, credential: Any = None
) -> tuple[ShardAssignment, list[str]]:
    """Write a record naming no trainer (every trainer back to its own --shard-ranges, from
    its next shard on: trainers keep the last record they obeyed, so deleting would not do),
    then delete ``key``'s older ones; the new record and the ids deleted."""
    reset = new_assignment({}, handover_s=0.0, ttl_s=ttl_s, credential=credential)
    await publish_assignment(dht, key, run_name, reset)
    key_name = shard_assignment_key(run_name)
    deleted = []
    for subkey, value in (await dht.get(key_name)).items():
        if value.writer == key.public_key and not subkey.endswith("/" + reset.id):
            await retrying(lambda subkey=subkey: dht.delete(key_name, subkey, signer=key), 10.0)
            deleted.append(subkey.rsplit("/", 1)[-1])
    return reset, deleted
