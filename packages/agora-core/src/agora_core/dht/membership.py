"""The full member list every DHT node keeps, and the rules for updating it (SWIM).

Each member has an incarnation number that only it may raise. News about a member travels as
an update ``(id, address, public key, incarnation, status)`` piggybacked on protocol traffic;
an update replaces what a node knows only if it is newer by SWIM's precedence:

* alive(i) beats alive/suspect/dead(j) when i > j
* suspect(i) beats alive(j) when i >= j, and suspect(j) when i > j
* dead/left(i) beats alive/suspect(j) when i >= j

A node that hears itself suspected or declared dead refutes it by raising its incarnation.
Incarnations start at the wall-clock time in milliseconds, so a restarted node (same key,
same id) outranks everything said about its previous life. Dead and departed members are
kept as tombstones for a while, so stale gossip cannot bring them back, then forgotten.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agora_core.dht.ids import node_position


class Status(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


GONE = (Status.DEAD, Status.LEFT)


@dataclass(slots=True)
class Member:
    node_id: str
    address: str
    public_key: bytes
    incarnation: int
    status: Status
    changed_at: float = 0.0  # time.monotonic() of the last status change (suspicion timers)

    @property
    def position(self) -> int:
        return node_position(self.node_id)

    def to_wire(self) -> list:
        return [self.node_id, self.address, self.public_key, self.incarnation, int(self.status)]


def parse_update(raw: Any) -> Member | None:
    """A member update from the wire, or None when malformed (it is then ignored)."""
    if not isinstance(raw, list) or len(raw) != 5:
        return None
    node_id, address, public_key, incarnation, status = raw
    if (
        not isinstance(node_id, str)
        or len(node_id) != 40
        or not isinstance(address, str)
        or not 0 < len(address) <= 256
        or not isinstance(public_key, bytes)
        or len(public_key) != 32
        or isinstance(incarnation, bool)
        or not isinstance(incarnation, int)
        or not 0 <= incarnation < 1 << 63
        or status not in (0, 1, 2, 3)
    ):
        return None
    try:
        node_position(node_id)
    except ValueError:
        return None
    return Member(node_id, address, public_key, incarnation, Status(status))


def _overrides(new: Member, old: Member) -> bool:
    if new.status == Status.ALIVE:
        return new.incarnation > old.incarnation
    if new.status == Status.SUSPECT:
        if old.status == Status.ALIVE:
            return new.incarnation >= old.incarnation
        return new.incarnation > old.incarnation
    # DEAD or LEFT
    if old.status in GONE:
        return new.incarnation > old.incarnation or (new.status == Status.LEFT and old.status == Status.DEAD)
    return new.incarnation >= old.incarnation


class MemberTable:
    """Members as this node sees them, plus the updates it still has to gossip."""

    def __init__(
        self,
        me: Member,
        *,
        suspicion_timeout_s: float,
        tombstone_s: float,
        retransmit_mult: int = 4,
        on_change: Callable[[], None] | None = None,
        on_new_member: Callable[[str], None] | None = None,
    ):
        self.me = me
        self._members: dict[str, Member] = {}
        self._suspicion_timeout_s = suspicion_timeout_s
        self._tombstone_s = tombstone_s
        self._retransmit_mult = retransmit_mult
        self._on_change = on_change or (lambda: None)
        self._on_new_member = on_new_member or (lambda node_id: None)
        self._gossip: dict[str, tuple[list, int]] = {}  # node id -> (update, times sent)
        self.leaving = False
        self.refutations = 0  # times this node denied being suspect or dead
        self.suspicions = 0  # times this node saw another member become suspect
        self.deaths = 0  # times this node saw another member declared dead
        self._queue(me)

    # --- views ------------------------------------------------------------------------------

    def live(self) -> list[Member]:
        """Alive and suspect members, this node included, ordered by id."""
        members = [m for m in self._members.values() if m.status not in GONE]
        if not self.leaving:
            members.append(self.me)
        return sorted(members, key=lambda m: m.node_id)

    def alive(self) -> list[Member]:
        """Members not under suspicion, this node included (the DHT's replica candidates)."""
        return [m for m in self.live() if m.status == Status.ALIVE]

    def others(self) -> list[Member]:
        """Live members other than this node: whom to probe and gossip with."""
        return [m for m in self._members.values() if m.status not in GONE]

    def get(self, node_id: str) -> Member | None:
        return self.me if node_id == self.me.node_id else self._members.get(node_id)

    def snapshot(self) -> list[list]:
        """Every member this node knows of, tombstones included (for joins and syncs)."""
        return [self.me.to_wire(), *(m.to_wire() for m in self._members.values())]

    def digest(self) -> str:
        """A short hash of the membership: two nodes with the same digest agree on it."""
        entries = sorted(
            (m.node_id, m.incarnation, int(m.status)) for m in (self.me, *self._members.values())
        )
        return hashlib.blake2b(repr(entries).encode(), digest_size=16).hexdigest()

    # --- updates ------------------------------------------------------------------------------

    def apply(self, update: Member, now: float | None = None) -> bool:
        """Merge one update; returns whether it changed anything (and queues its gossip)."""
        now = time.monotonic() if now is None else now
        if update.node_id == self.me.node_id:
            self._about_me(update)
            return False
        old = self._members.get(update.node_id)
        if old is None:
            update.changed_at = now
            self._members[update.node_id] = update
            self._count(update.status)
            if update.status not in GONE:
                self._queue(update)
                self._on_new_member(update.node_id)
                self._on_change()
            return update.status not in GONE
        if not _overrides(update, old):
            return False
        if update.status != old.status:
            old.changed_at = now
            self._count(update.status)
        if update.status == Status.ALIVE or old.status in GONE:
            old.address, old.public_key = update.address, update.public_key
        old.incarnation, old.status = update.incarnation, update.status
        self._queue(old)
        self._on_change()
        return True

    def _count(self, status: Status) -> None:
        if status == Status.SUSPECT:
            self.suspicions += 1
        elif status == Status.DEAD:
            self.deaths += 1

    def _about_me(self, update: Member) -> None:
        if self.leaving:
            return
        me = self.me
        doubted = update.status != Status.ALIVE and update.incarnation >= me.incarnation
        if doubted or update.incarnation > me.incarnation:
            me.incarnation = update.incarnation + 1
            if doubted:
                self.refutations += 1
            self._queue(me)

    def suspect(self, node_id: str, now: float | None = None) -> bool:
        member = self._members.get(node_id)
        if member is None or member.status != Status.ALIVE:
            return False
        return self.apply(
            Member(member.node_id, member.address, member.public_key, member.incarnation, Status.SUSPECT), now
        )

    def leave(self) -> None:
        """Announce a graceful departure: others drop us without suspicion."""
        self.leaving = True
        self.me.incarnation += 1
        self.me.status = Status.LEFT
        self._queue(self.me)

    def expire(self, now: float | None = None) -> None:
        """Declare members suspected for too long dead; forget old tombstones."""
        now = time.monotonic() if now is None else now
        for member in list(self._members.values()):
            age = now - member.changed_at
            if member.status == Status.SUSPECT and age >= self._suspicion_timeout_s:
                self.apply(
                    Member(
                        member.node_id, member.address, member.public_key, member.incarnation, Status.DEAD
                    ),
                    now,
                )
            elif member.status in GONE and age >= self._tombstone_s:
                del self._members[member.node_id]
                self._gossip.pop(member.node_id, None)

    # --- dissemination --------------------------------------------------------------------------

    @property
    def pending_gossip(self) -> int:
        """Updates not yet sent their full number of times."""
        return len(self._gossip)

    def _queue(self, member: Member) -> None:
        self._gossip[member.node_id] = (member.to_wire(), 0)

    def piggyback(self, limit: int) -> list[list]:
        """Up to ``limit`` updates to attach to an outgoing message, least-sent first.

        Each update is sent ``retransmit_mult * log2(N + 1)`` times, enough for infection-style
        spreading to reach every member with high probability, then retired.
        """
        if not self._gossip:
            return []
        budget = self._retransmit_mult * math.ceil(math.log2(len(self._members) + 2))
        chosen = heapq.nsmallest(limit, self._gossip.items(), key=lambda item: item[1][1])
        updates = []
        for node_id, (update, sent) in chosen:
            updates.append(update)
            if sent + 1 >= budget:
                del self._gossip[node_id]
            else:
                self._gossip[node_id] = (update, sent + 1)
        return updates

    def apply_all(self, raw_updates: Any, now: float | None = None) -> int:
        """Merge a list of wire updates; malformed ones are skipped. Returns how many changed."""
        if not isinstance(raw_updates, list):
            return 0
        changed = 0
        for raw in raw_updates[:1024]:
            update = parse_update(raw)
            if update is not None and self.apply(update, now):
                changed += 1
        return changed
