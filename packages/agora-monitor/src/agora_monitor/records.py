"""Which of the records a run publishes the monitor believes, and why not the others.

The DHT checks a record's signature against the writer it names before a reader sees it
(a copy that fails is dropped on the read path), so what reaches the monitor was signed by
*someone*. The monitor checks that the someone is who the record claims to be:

* ``unsigned``: no writer at all (an open run's DHT may store those);
* ``writer_not_owner``: an owned subkey written by another key;
* ``node_id_mismatch``: the value names a node id that is not its writer's (one node
  reporting for another: inflating someone's progress, or hiding its own);
* ``malformed``: the value does not parse as its key's schema.

Each refusal becomes a :class:`Flag`; the record is left out of every total.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agora_core.dht import DhtValue
from agora_core.dht.records import RecordRejected
from agora_core.identity import node_id_from_public_key

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """Something the monitor distrusts: ``subject`` (a node id, or ``stage/N``), ``kind``, why."""

    subject: str
    kind: str
    detail: str


def writer_problem(value: DhtValue, claimed_node_id: str) -> str | None:
    """Why ``value`` (whose payload claims to come from ``claimed_node_id``) is not that
    node's own record; None when it is."""
    if value.writer is None:
        return "unsigned"
    if value.owner is not None and value.owner != value.writer:
        return "writer_not_owner"
    if node_id_from_public_key(value.writer) != claimed_node_id:
        return "node_id_mismatch"
    return None


def checked_entries(
    key: str, values: Mapping[str, DhtValue], parse: Callable[[Any], T]
) -> tuple[list[tuple[T, DhtValue]], list[Flag]]:
    """The entries under ``key`` that parse and were written by the node they name, each
    with its DHT value; and a flag for every other entry."""
    accepted: list[tuple[T, DhtValue]] = []
    flags: list[Flag] = []
    for value in values.values():
        writer = node_id_from_public_key(value.writer) if value.writer is not None else "unsigned"
        try:
            record = parse(value.value)
        except RecordRejected as exc:
            flags.append(Flag(writer, "malformed", f"{key}: {exc}"))
            continue
        problem = writer_problem(value, record.node_id)
        if problem is not None:
            flags.append(
                Flag(
                    record.node_id,
                    problem,
                    f"{key}: record for {record.node_id[:12]} written by {writer[:12]}",
                )
            )
            continue
        accepted.append((record, value))
    return accepted, flags


def averaging_report(value: Any) -> dict:
    """A worker's averaging summary: a map whose success fractions are numbers in [0, 1]
    (RecordRejected otherwise); it names no node id, so its writer is its node."""
    if not isinstance(value, dict):
        raise RecordRejected("an averaging summary must be a map")
    report = {}
    for name in ("averaging_success", "reduce_success"):
        item = value.get(name)
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not 0.0 <= item <= 1.0:
            raise RecordRejected(f"averaging summary field {name!r} must be a number in [0, 1]")
        report[name] = float(item)
    return report
