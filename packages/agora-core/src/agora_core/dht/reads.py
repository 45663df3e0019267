"""Quorum reads with hedging: which of a key's replicas a get asks, and when it stops waiting.

Asking all R replicas and waiting for every answer made each get as slow as the slowest of
R, and cost R requests where fewer settle the question: where many nodes share one process
(tests, benchmarks) a request's CPU is the latency, and on the internet the slowest of R
round trips is the tail. A read now asks a majority, Q = R // 2 + 1, of each key's replicas:
this node first when it is one (its answer costs no message), then the others in random
order (spreading the load, and letting read repair reach every replica over time). It asks
the next replica at once when one fails, and when Q answers are not in within the hedge
delay (twice the typical recent answer time): a slow or frozen replica costs that delay, not
the read's timeout. Answers still outstanding once Q are in are left to finish in the
background, for read repair.

Why a majority keeps read-your-writes for records written by ``Replication.write``: a write
stores at every replica and returns once each has answered. When all R accepted, every
replica holds the record, so any answer carries it. When only some accepted (the others
were unreachable), a majority read still sees it whenever R - Q + 1 replicas (2 of 3) did,
because any Q replicas include one of those. Stopping at the first answer would lose that.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from agora_core import world
from agora_core.dht.membership import Member

Answer = dict[str, dict[str, Any]]  # key -> subkey -> record, as one replica holds them


class HedgeDelay:
    """How long a read waits for its quorum before asking one more replica: twice the median
    of the latest answer times, so it tracks the network (a LAN, an ocean) without a setting,
    within ``[floor_s, ceiling_s]``. While nothing is known it is the floor: hedging early
    costs a request, waiting on a frozen replica would cost the read."""

    def __init__(self, floor_s: float, ceiling_s: float, window: int = 64):
        self.floor_s = floor_s
        self.ceiling_s = ceiling_s
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._delay = floor_s
        self._since = 0  # answers observed since the delay was last computed

    def observe(self, seconds: float) -> None:
        self._recent.append(seconds)
        self._since += 1
        if self._since >= 8 or len(self._recent) < 8:  # sorting 64 floats per answer is waste
            self._since = 0
            ordered = sorted(self._recent)
            self._delay = min(self.ceiling_s, max(self.floor_s, 2 * ordered[len(ordered) // 2]))

    @property
    def seconds(self) -> float:
        return self._delay


class QuorumRead:
    """One read of ``keys``: ``await run()`` returns the answers in hand once each key has Q
    of them (or no replica is left to ask); ``late`` then holds the calls still outstanding
    (task -> the member asked), for the caller's background read repair."""

    def __init__(
        self,
        keys: Sequence[str],
        replicas: Callable[[str], list[Member]],
        *,
        local_id: str,
        local: Callable[[list[str]], Answer],
        remote: Callable[[Member, list[str]], Coroutine[Any, Any, Answer]],
        hedge: HedgeDelay,
        rng: random.Random,
    ):
        self._remote = remote
        self._hedge = hedge
        self.answers: list[tuple[Member, Answer]] = []
        self.late: dict[asyncio.Task, Member] = {}
        self._plans: dict[str, list[Member]] = {}
        self._need: dict[str, int] = {}
        self._good: dict[str, int] = {}
        self._outstanding: dict[str, int] = {}
        mine: list[str] = []
        for key in keys:
            members = replicas(key)
            others = [m for m in members if m.node_id != local_id]
            rng.shuffle(others)
            self._plans[key] = others[::-1]  # popped from the end: the order asked
            self._need[key] = len(members) // 2 + 1
            self._good[key] = 0
            self._outstanding[key] = 0
            if len(others) < len(members):
                mine.append(key)
        if mine:
            me = next(m for m in replicas(mine[0]) if m.node_id == local_id)
            self.answers.append((me, local(mine)))
            for key in mine:
                self._good[key] = 1
        self._started: dict[asyncio.Task, float] = {}
        self._keys: dict[asyncio.Task, list[str]] = {}

    def _lacking(self) -> list[str]:
        return [key for key, need in self._need.items() if self._good[key] < need]

    def _launch(self, want: Callable[[str], int]) -> None:
        """Ask ``want(key)`` more replicas of every key lacking answers, one call per member."""
        groups: dict[str, tuple[Member, list[str]]] = {}
        for key in self._lacking():
            plan = self._plans[key]
            for _ in range(min(want(key), len(plan))):
                member = plan.pop()
                groups.setdefault(member.node_id, (member, []))[1].append(key)
                self._outstanding[key] += 1
        loop = asyncio.get_running_loop()
        now = world.monotonic()
        for member, keys in groups.values():
            task = loop.create_task(self._remote(member, keys))
            self.late[task] = member
            self._keys[task] = keys
            self._started[task] = now

    async def run(self) -> list[tuple[Member, Answer]]:
        self._launch(lambda key: self._need[key] - self._good[key])
        try:
            while self.late and self._lacking():
                # with nobody left to hedge to, wake for answers only (not every few ms)
                spare = any(self._plans[key] for key in self._lacking())
                done, _ = await asyncio.wait(
                    self.late,
                    timeout=self._hedge.seconds if spare else None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in [t for t in self.late if t in done]:  # launch order, not the set's
                    self._settle(task)
                if done:  # replace the replicas that failed
                    self._launch(lambda key: self._need[key] - self._good[key] - self._outstanding[key])
                else:  # the quorum is late: one more replica of each key still short
                    self._launch(lambda key: 1)
        except BaseException:
            for task in self.late:
                task.cancel()
            raise
        return self.answers

    def _settle(self, task: asyncio.Task) -> None:
        member = self.late.pop(task)
        keys = self._keys.pop(task)
        started = self._started.pop(task)
        for key in keys:
            self._outstanding[key] -= 1
        if task.cancelled() or task.exception() is not None:
            return
        self._hedge.observe(world.monotonic() - started)
        self.answers.append((member, task.result()))
        for key in keys:
            self._good[key] += 1
