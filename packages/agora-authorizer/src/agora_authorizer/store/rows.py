"""What the store hands back, frozen snapshots of its rows, and the checks on what it is given.

Callers keep and pass rows around freely (a status page, a refresh decision) without holding
a connection or risking a later write changing them underfoot. Field names are the column
names of :mod:`.schema`. Arguments a caller got wrong raise ValueError before any database
work: they are bugs to fix, not conditions of the database.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from sqlalchemy import Column, Table


@dataclass(frozen=True, kw_only=True, slots=True)
class Account:
    """A contributor account the operator created; nodes join under it with its token."""

    name: str
    max_nodes: int | None  # most nodes with a live credential at once; None: the run's max_nodes_per_account
    created: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Standing:
    """What the accountability check reads about a joiner (:meth:`Store.standing`)."""

    account: Account | None  # None: no such account, or the token is wrong
    account_banned: bool
    node_banned: bool
    live_nodes: int  # the account's other nodes holding a live credential
    queued_nodes: int  # the account's other nodes waiting in the queue
    pin: int | None  # the stage an operator pinned the node to


@dataclass(frozen=True, kw_only=True, slots=True)
class Ban:
    kind: str  # "node" (target is a node id) or "account" (target is an account name)
    target: str
    reason: str
    created: float


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionRequest:
    """One join request and what the authorizer decided about it."""

    id: int  # increasing in arrival order
    node_id: str
    public_key: bytes
    role: str
    address: str
    account: str
    hardware: dict
    software: dict
    status: str  # checking, queued, admitted, refused
    reason: str | None  # the refusal reason code when refused
    detail: str | None
    stage: int | None  # placement of a queued or admitted worker
    checks: dict | None  # measurements: latency_ms, bandwidth_mbps, challenge_s...
    received: float
    decided: float | None  # when it was admitted or refused


@dataclass(frozen=True, kw_only=True, slots=True)
class IssuedCredential:
    """A credential the authorizer signed, with the exact bytes it sent."""

    serial: int  # unique and increasing; the credential's body carries it
    request_id: int | None  # the admission it answered; None for a refresh
    node_id: str
    public_key: bytes
    role: str
    stage: int | None
    account: str
    issued: float
    expires: float
    body: bytes
    signature: bytes
    revoked: float | None  # when it was revoked; None while it stands

    def live(self, now: float) -> bool:
        return self.revoked is None and self.expires > now


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedAccusation:
    """One node's accusation of another, of one kind, as the authorizer last read it."""

    accuser: str
    accused: str
    kind: str  # agora_core.admission.accusations.KINDS
    accuser_stage: int  # the stage the accuser's entry names, -1 a trainer's (its credential's counts)
    rounds: int  # distinct rounds the accuser saw it in
    at: float  # the accuser's clock: the newest of those rounds
    at_seen: float  # the authorizer's clock: when it first read that ``at``
    evidence: list  # [{round, slice, chunk, measured, radius}, ...], newest rounds first
    first_seen: float  # when the authorizer first read this accusation
    last_seen: float  # when it last read it in the DHT

    @property
    def made(self) -> float:
        """When the accusation was last made, as far as the authorizer can tell: ``at``, but
        never later than the authorizer first read it (an accuser's clock may run ahead)."""
        return min(self.at, self.at_seen)


@dataclass(frozen=True, kw_only=True, slots=True)
class Docket:
    """What the accusation rules read (:meth:`Store.docket`), in one read transaction."""

    accusations: tuple[RecordedAccusation, ...]
    credentials: dict[str, IssuedCredential]  # node id -> newest credential, for every node named
    pardons: dict[str, float]  # accused node id -> its latest pardon
    banned: frozenset[str]  # the accused node ids that are banned


@dataclass(frozen=True, kw_only=True, slots=True)
class Pardon:
    """What :meth:`Store.pardon` did."""

    node_id: str
    ban_reason: str | None  # the node ban it lifted; None: the node was not banned
    forgiven: int  # accusations made against it since its previous pardon, which count no more
    pardoned: float | None  # the pardon's time; None: nothing to pardon, nothing recorded


# --- what goes in: checks on the values the store's methods are given -----------------------


def columns_of(table: Table, row_class: type) -> list[Column]:
    """The columns of ``table`` that ``row_class`` has fields for, in field order."""
    return [table.c[field.name] for field in dataclasses.fields(row_class)]


def check_text(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, not {value!r}")
    return value


def check_stage(value: object) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"a stage is a non-negative int or None, not {value!r}")
    return value


def check_choice(what: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, not {value!r}")
    return value  # type: ignore[return-value]
