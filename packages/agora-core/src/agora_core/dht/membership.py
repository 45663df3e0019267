"""The full member list every DHT node keeps, and the rules for updating it (SWIM).

Each member has an incarnation number that only it may raise. News about a member travels as
an update ``[id, address, public key, incarnation, status, signature, credential]``
piggybacked on protocol traffic. Only a member's own signed claims change what others hold
about it (see ``claims``): ALIVE(i) replaces anything older than i (a refutation, a restart,
a new address or credential), LEFT(i) ends it. SUSPECT and DEAD reports by others are hints:
they make this node probe the member itself, and only this node's own failed probes make it
suspect here, its suspicion timeout dead. Claims are checked for precedence first and their
signatures only when they would change the table, so stale repeated gossip costs nothing.

A node that hears itself suspected or declared dead at its incarnation refutes it by raising
its incarnation by one, signed. Incarnations start at the wall-clock time in milliseconds, so
a restarted node (same key, same id) outranks everything said about its previous life; if that
life's clock ran ahead, the node claims above its signed claim (:meth:`MemberTable.outrank`). Dead
and departed members are kept as tombstones for a while, so stale gossip cannot bring them
back, then forgotten. In an authorized run a member whose credential expires, or is revoked,
is dropped from the live view until it claims again with a valid one.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agora_core import world
from agora_core.dht.gossip_queue import GossipQueue
from agora_core.dht.member import (
    GONE,
    HINTS,
    MAX_UPDATES_PER_MESSAGE,
    Budget,
    Member,
    Status,
    overrides,
    parse_update,
)

if TYPE_CHECKING:
    from agora_core.dht.claims import Claims

__all__ = ["GONE", "HINTS", "Budget", "Member", "MemberTable", "Status", "parse_update"]


class MemberTable:
    """Members as this node sees them, plus the updates it still has to gossip."""

    def __init__(
        self,
        me: Member,
        *,
        claims: Claims,
        suspicion_timeout_s: float,
        tombstone_s: float,
        retransmit_mult: int = 4,
        on_change: Callable[[], None] | None = None,
        on_new_member: Callable[[str], None] | None = None,
        on_hint: Callable[[Member], None] | None = None,
        on_address: Callable[[Member], None] | None = None,
        on_dead: Callable[[Member], None] | None = None,
    ):
        """``on_hint(member)``: someone reported ``member`` suspect or dead (probe it);
        ``on_address(member)``: a member entered or moved to a new address;
        ``on_dead(member)``: this node declared ``member`` dead (or dropped it)."""
        self.me = me
        self.claims = claims
        self._members: dict[str, Member] = {}
        self._suspicion_timeout_s = suspicion_timeout_s
        self._refuted_at = -math.inf  # world.monotonic() of the last refutation
        self._tombstone_s = tombstone_s
        self._retransmit_mult = retransmit_mult
        self._on_change_listener = on_change or (lambda: None)
        # Views worked out once per change of the table, not per probe and period: at a
        # thousand members, scanning them all several times a period per node was most of a
        # node's idle CPU. Every mutation of a member's status or of the table calls _touch.
        self._version = 0  # counts changes of the table: the cached views below are of one
        self._others: list[Member] | None = None
        self._live: list[Member] = []
        self._live_key: tuple | None = None
        self._digest = ""
        self._digest_key: tuple | None = None
        self._aging: list[Member] | None = None  # suspect or gone: what expire() looks at
        self._first_expiry = -math.inf  # the earliest credential expiration among members
        self._on_new_member = on_new_member or (lambda node_id: None)
        self._on_hint = on_hint or (lambda member: None)
        self._on_address = on_address or (lambda member: None)
        self._on_dead = on_dead or (lambda member: None)
        self._gossip = GossipQueue()  # updates still to send
        self.news = asyncio.Event()  # set when an update is queued: wakes a quiet gossip push
        self.leaving = False
        self.refutations = 0  # times this node denied being suspect or dead
        self.suspicions = 0  # times this node saw another member become suspect
        self.deaths = 0  # times this node saw another member declared dead
        self.dropped = 0  # members dropped for an expired or revoked credential
        claims.sign(me)
        self._queue(me)

    # --- views ------------------------------------------------------------------------------

    def live(self) -> list[Member]:
        """Alive and suspect members, this node included, ordered by id (shared: do not
        modify the list)."""
        key = (self._version, self.leaving)
        if self._live_key != key:
            members = list(self.others())
            if not self.leaving:
                members.append(self.me)
            self._live, self._live_key = sorted(members, key=lambda m: m.node_id), key
        return self._live

    def live_count(self) -> int:
        return len(self.others()) + (0 if self.leaving else 1)

    def alive(self) -> list[Member]:
        """Members not under suspicion, this node included (the DHT's replica candidates)."""
        return [m for m in self.live() if m.status == Status.ALIVE]

    def others(self) -> list[Member]:
        """Live members other than this node: whom to probe and gossip with (shared: do not
        modify the list)."""
        if self._others is None:
            self._others = [m for m in self._members.values() if m.status not in GONE]
        return self._others

    def suspects(self) -> list[Member]:
        """Members this node holds suspect."""
        return [m for m in self._aging_members() if m.status == Status.SUSPECT]

    def dead(self) -> list[Member]:
        """Members this node holds dead (not those that left, nor the revoked)."""
        return [m for m in self._aging_members() if m.status == Status.DEAD and not m.revoked]

    def _aging_members(self) -> list[Member]:
        if self._aging is None:
            self._aging = [m for m in self._members.values() if m.status != Status.ALIVE]
        return self._aging

    def _touch(self) -> None:
        self._version += 1
        self._others = self._aging = None
        self._first_expiry = -math.inf

    def _on_change(self) -> None:
        self._touch()
        self._on_change_listener()

    def known(self) -> list[Member]:
        """Every member not yet forgotten, tombstones and this node included."""
        return [self.me, *self._members.values()]

    def get(self, node_id: str) -> Member | None:
        return self.me if node_id == self.me.node_id else self._members.get(node_id)

    def snapshot(self) -> list[list]:
        """Every member this node knows of, tombstones included (for joins and syncs)."""
        return [m.to_wire() for m in self.known()]

    def digest(self) -> str:
        """A short hash of the membership: two nodes with the same digest agree on it."""
        key = (self._version, self.me.incarnation, self.me.status)
        if self._digest_key != key:
            entries = sorted((m.node_id, m.incarnation, int(m.status)) for m in self.known())
            self._digest = hashlib.blake2b(repr(entries).encode(), digest_size=16).hexdigest()
            self._digest_key = key
        return self._digest

    # --- updates ------------------------------------------------------------------------------

    def apply(self, update: Member, now: float | None = None, budget: Budget | None = None) -> bool:
        """Merge one update; returns whether it changed anything (and queues its gossip).

        ``budget`` bounds how many claims may be checked for this update's message.
        """
        if update.node_id == self.me.node_id:
            self._about_me(update)
            return False
        now = world.monotonic() if now is None else now
        old = self._members.get(update.node_id)
        if old is None:
            return self._enter(update, now, budget)
        if update.status in HINTS:
            if old.status == Status.ALIVE and update.incarnation >= old.incarnation:
                self._on_hint(old)
            return False
        if not overrides(update, old) or not self._check(update, budget):
            return False
        old.hearsay = False
        if update.status != old.status:
            old.changed_at = now
        moved = update.status == Status.ALIVE and update.address != old.address
        old.address, old.incarnation, old.status = update.address, update.incarnation, update.status
        old.signature, old.credential = update.signature, update.credential
        old.identity, old.expires, old.revoked = update.identity, update.expires, False
        if moved:
            self._on_address(old)
        self._queue(old)
        self._on_change()
        return True

    def _enter(self, update: Member, now: float, budget: Budget | None) -> bool:
        """A member this node does not know enters only through its own signed claim. A report
        about it carries the ALIVE claim it is about: SUSPECT enters it alive and probes it
        here; DEAD leaves a tombstone from hearsay, which that same claim lifts."""
        if not self._check(update, budget):
            return False
        update.changed_at = now
        self._members[update.node_id] = update
        self._touch()
        if update.status in GONE:
            update.hearsay = update.status == Status.DEAD
            return False  # a tombstone: blocks stale claims, changes no view
        suspected = update.status == Status.SUSPECT
        update.status = Status.ALIVE
        if not suspected:
            self._queue(update)
        self._on_new_member(update.node_id)
        self._on_address(update)
        self._on_change()
        if suspected:
            self._on_hint(update)
        return True

    def _check(self, update: Member, budget: Budget | None) -> bool:
        if not self.claims.plausible(update):
            return False
        if budget is not None and not budget.take():
            return False
        return self.claims.admit(update)

    def _about_me(self, update: Member) -> None:
        """Refute a report that I am suspect or dead at my incarnation, or above it when the
        claim it carries is my own key's (a previous life whose clock ran ahead: restarted on a
        machine whose clock is behind). Claims in my name are not mine to heed."""
        if self.leaving or update.status not in HINTS or update.incarnation < self.me.incarnation:
            return
        if update.incarnation > self.me.incarnation and not self.claims.mine(update):
            return  # above mine, and not a life of mine: nobody else raises my incarnation
        # At most one refutation per fifth of the suspicion timeout: anyone who knows my
        # incarnation could report me at it over and over, each costing a signature here and
        # a check everywhere. A genuine suspecter keeps saying so, and is answered in time.
        now = world.monotonic()
        if now - self._refuted_at < self._suspicion_timeout_s / 5:
            return
        self._refuted_at = now
        self.refutations += 1
        self._raise_incarnation(above=update.incarnation)

    def _raise_incarnation(self, above: int = 0) -> None:
        self.me.incarnation = max(self.me.incarnation, above) + 1
        self.claims.sign(self.me)
        self._queue(self.me)

    def outrank(self, held: Member) -> bool:
        """Claim again above ``held``, what a member holds of this node's id at an incarnation
        this node's claim does not outrank (a join answered so): when it is a previous life's
        own signed claim. Returns whether it did."""
        if self.leaving or held.node_id != self.me.node_id or not self.claims.mine(held):
            return False
        self._raise_incarnation(above=held.incarnation)
        return True

    def reclaim(self) -> None:
        """Claim again at a raised incarnation, outranking whatever others hold about this
        node (a node that was cut off long enough to be declared dead)."""
        if not self.leaving:
            self._raise_incarnation()

    def doubt_own_verdicts(self) -> list[Member]:
        """This node was cut off from everyone: the members it declared dead meanwhile may be
        fine. Their tombstones become hearsay, so their own claims, heard again through the
        swarm, bring them back (those truly dead stay dead: nobody claims for them). Returns
        them (their addresses are where to look for the swarm)."""
        dead = [m for m in self._members.values() if m.status == Status.DEAD and not m.revoked]
        for member in dead:
            member.hearsay = True
        return dead

    def credential_changed(self) -> None:
        """Claim again with this node's fresh credential (a higher incarnation outranks the
        claim that named the old one)."""
        if not self.leaving:
            self._raise_incarnation()

    def _set_status(self, member: Member, status: Status, now: float, *, gossip: bool = True) -> None:
        member.status, member.changed_at = status, now
        if status == Status.SUSPECT:
            self.suspicions += 1
        elif status == Status.DEAD and gossip:
            self.deaths += 1
        if gossip:
            self._queue(member)
        self._on_change()
        if status == Status.DEAD:
            self._on_dead(member)

    def suspect(self, node_id: str, now: float | None = None) -> bool:
        """This node's own probes of ``node_id`` failed: suspect it here and say so."""
        member = self._members.get(node_id)
        if member is None or member.status != Status.ALIVE:
            return False
        self._set_status(member, Status.SUSPECT, world.monotonic() if now is None else now)
        return True

    def drop(self, predicate: Callable[[Member], bool], *, revoked: bool = False) -> int:
        """Take members ``predicate`` picks out of the live view (their credential stopped
        counting); a later claim with a valid credential brings one back. Returns how many."""
        now = world.monotonic()
        count = 0
        for member in list(self._members.values()):
            if member.status not in GONE and predicate(member):
                self._set_status(member, Status.DEAD, now, gossip=False)  # each node checks itself
                count += 1
            if revoked and predicate(member):
                member.revoked = True
        self.dropped += count
        return count

    def leave(self) -> None:
        """Announce a graceful departure: others drop us without suspicion."""
        self.leaving = True
        self.me.incarnation += 1
        self.me.status = Status.LEFT
        self.claims.sign(self.me)
        self._queue(self.me)

    def expire(self, now: float | None = None, wall_now: float | None = None) -> None:
        """Declare members suspected for too long dead; drop those whose credential expired;
        forget old tombstones."""
        now = world.monotonic() if now is None else now
        wall_now = world.wall() if wall_now is None else wall_now
        if self._first_expiry == -math.inf:
            self._first_expiry = min((m.expires for m in self._members.values()), default=math.inf)
        if wall_now >= self._first_expiry:
            self.drop(lambda m: m.expires <= wall_now)
        for member in list(self._aging_members()):
            age = now - member.changed_at
            if member.status == Status.SUSPECT and age >= self._suspicion_timeout_s:
                self._set_status(member, Status.DEAD, now)
            elif member.status in GONE and age >= self._tombstone_s:
                del self._members[member.node_id]
                self._gossip.discard(member.node_id)
                self._touch()

    # --- dissemination --------------------------------------------------------------------------

    @property
    def pending_gossip(self) -> int:
        """Updates not yet sent their full number of times."""
        return len(self._gossip)

    def _queue(self, member: Member) -> None:
        self._gossip.put(member.node_id, member.to_wire())
        self.news.set()

    def piggyback(self, limit: int) -> list[list]:
        """Up to ``limit`` updates to attach to an outgoing message, least-sent first.

        Each update is sent ``retransmit_mult * log2(N + 1)`` times, enough for infection-style
        spreading to reach every member with high probability, then retired.
        """
        if not self._gossip:
            return []
        budget = self._retransmit_mult * math.ceil(math.log2(len(self._members) + 2))
        return self._gossip.take(limit, budget)

    def apply_all(
        self,
        raw_updates: Any,
        now: float | None = None,
        budget: Budget | None = None,
        limit: int = MAX_UPDATES_PER_MESSAGE,
    ) -> int:
        """Merge a list of wire updates (at most ``limit``: a member list may hold more than a
        gossip message); malformed ones are skipped. Returns how many changed."""
        if not isinstance(raw_updates, list):
            return 0
        changed = 0
        for raw in raw_updates[:limit]:
            if self._held_already(raw):
                continue
            update = parse_update(raw)
            if update is not None and self.apply(update, now, budget):
                changed += 1
        return changed

    def _held_already(self, raw: Any) -> bool:
        """Whether ``raw`` is an ALIVE claim of a known member at an incarnation this table
        holds or has passed, which ``apply`` would ignore: it is then not parsed or checked. A
        mass join's gossip brings each claim about 4 log2(N) times to every member."""
        if type(raw) is not list or len(raw) != 7 or raw[4] != Status.ALIVE:
            return False
        old = self._members.get(raw[0]) if type(raw[0]) is str else None
        incarnation = raw[3]
        if old is None or type(incarnation) is not int:
            return False
        return incarnation < old.incarnation or (incarnation == old.incarnation and not old.hearsay)
