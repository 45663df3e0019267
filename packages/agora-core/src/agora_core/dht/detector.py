"""SWIM failure detection: each period, probe one member directly, then through k others.

Targets are taken round-robin from a shuffled list of the other members, so every member is
probed within two passes of the list. A member whose connection just dropped is probed at
once, out of turn: a crashed process is suspected within a period instead of a pass, and so is
a member another node reports suspect or dead (reports are only hints: this node's own probes
decide). Out-of-turn probes are bounded: one per member per period, ``MAX_URGENT`` at a time.
A member that answers neither the direct ping nor any of the ``indirect_probes`` helpers
within the period becomes suspect; the member table turns a suspicion that nobody refutes
into death after the suspicion timeout. Each period one suspect member is pinged again (the
ping carries this node's suspicion of it), so a member that was only slow hears it and refutes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from agora_core import world
from agora_core.dht.membership import GONE, Member, MemberTable, Status

MAX_URGENT = 8  # out-of-turn probes in flight at once

Ping = Callable[[Member, float], Awaitable[bool]]  # (target, timeout_s) -> answered
PingThrough = Callable[[Member, Member, float], Awaitable[bool]]  # (helper, target, timeout_s)


class FailureDetector:
    def __init__(
        self,
        table: MemberTable,
        *,
        period_s: float,
        probe_timeout_s: float,
        indirect_probes: int,
        ping: Ping,
        ping_through: PingThrough,
        rng: random.Random | None = None,
    ):
        self._table = table
        self._period_s = period_s
        self._probe_timeout_s = probe_timeout_s
        self._indirect = indirect_probes
        self._ping = ping
        self._ping_through = ping_through
        self._rng = rng or world.rng()
        self._order: list[str] = []
        self._urgent: set[str] = set()  # members being probed out of turn
        self._urgent_at: dict[str, float] = {}  # node id -> world.monotonic() of its last one
        self._suspects: list[str] = []  # this pass's order of suspects to ping again
        self.probes = 0
        self.failed_probes = 0

    def member_added(self, node_id: str) -> None:
        """Put a newcomer at a random place in this pass's probe order (as SWIM does), so it
        is probed within this pass rather than only from the next one."""
        self._order.insert(self._rng.randint(0, len(self._order)), node_id)

    def _next_target(self) -> Member | None:
        for _ in range(2):
            while self._order:
                member = self._table.get(self._order.pop())
                if member is not None and member.status not in GONE and member is not self._table.me:
                    return member
            self._order = [m.node_id for m in self._table.others()]
            self._rng.shuffle(self._order)
        return None

    async def probe_once(self) -> None:
        """One protocol period's probe; returns within the period."""
        target = self._next_target()
        if target is not None:
            await self._probe(target)

    def probe_now(self, member: Member) -> None:
        """Probe ``member`` at once, outside the cycle (its connection dropped, or someone
        reported it): at most once a period per member and ``MAX_URGENT`` at a time."""
        if member.status != Status.ALIVE or member is self._table.me or len(self._urgent) >= MAX_URGENT:
            return
        now = world.monotonic()
        if member.node_id in self._urgent or now - self._urgent_at.get(member.node_id, -1e9) < self._period_s:
            return
        if len(self._urgent_at) > 4 * MAX_URGENT:
            self._urgent_at = {k: t for k, t in self._urgent_at.items() if now - t < self._period_s}
        self._urgent.add(member.node_id)
        self._urgent_at[member.node_id] = now
        task = asyncio.get_running_loop().create_task(self._probe(member))
        task.add_done_callback(lambda _task: self._urgent.discard(member.node_id))

    async def recheck_suspect(self) -> None:
        """Ping one member this node suspects (the ping tells it so, so it can refute)."""
        while self._suspects:
            member = self._table.get(self._suspects.pop())
            if member is not None and member.status == Status.SUSPECT:
                await self._ping(member, self._probe_timeout_s)
                return
        self._suspects = [m.node_id for m in self._table.suspects()]

    async def _probe(self, target: Member) -> None:
        self.probes += 1
        deadline = world.monotonic() + self._period_s
        if await self._ping(target, self._probe_timeout_s):
            return
        helpers = [m for m in self._table.others() if m.node_id != target.node_id]
        helpers = self._rng.sample(helpers, min(self._indirect, len(helpers)))
        remaining = deadline - world.monotonic()
        if helpers and remaining > 0:
            answers = await asyncio.gather(*(self._ping_through(h, target, remaining) for h in helpers))
            if any(answers):
                return
        self.failed_probes += 1
        self._table.suspect(target.node_id)

    async def run(self) -> None:
        """Probe once per period at a fixed cadence, and age suspicions, until cancelled.

        The cadence starts at a random phase: members started together (a swarm brought up at
        once, many nodes in one process) would otherwise probe in one burst every period."""
        next_tick = world.monotonic() + self._rng.uniform(0, self._period_s)
        await asyncio.sleep(next_tick - world.monotonic())
        while True:
            next_tick += self._period_s
            if self._suspects or self._table.suspects():
                await asyncio.gather(self.probe_once(), self.recheck_suspect())
            else:  # the common case, without two tasks a period
                await self.probe_once()
            self._table.expire()
            delay = next_tick - world.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                next_tick = world.monotonic()  # overran (a slow period): do not try to catch up
