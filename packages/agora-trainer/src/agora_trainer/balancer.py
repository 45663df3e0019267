"""Per-stage load balancing: a min-heap of workers keyed by virtual runtime.

Choosing a worker charges it the task's estimated cost up front (task size / its measured
throughput), so a slower worker is charged more per sample and receives proportionally fewer.
Each completed call updates the worker's throughput estimate by Little's law: the calls this
trainer had in flight at that worker, over the call's duration. A worker that merges four
requests into one batch is credited with four samples per batch time, not one. Workers in
weight sync, and workers the DHT has declared dead, are invisible.

A worker that comes into use -- newly discovered, out of weight sync, back from a ban -- enters
level with the most-loaded usable worker at that moment, not at the virtual runtime it had
when it was last seen (nor at zero): the others were charged all the while, and it would take
every request of the stage until it caught up. For a joiner fresh out of weight sync that
also stalls the stage: its optimizer-sync samples do not count toward the stage's batch.

A worker whose call failed is banned for a while. When every worker of the stage is banned,
the one that failed longest ago is tried again once per ``probe_s`` (a probe) rather than left
idle until its ban lapses: a failure that was the trainer's own (its link dropped, so every
call failed) would otherwise stall the stage for the whole ban after the link returns. A
call that succeeds lifts its worker's ban.

A worker the trainer distrusts (its samples' losses were outliers, ``agora_trainer.witness``)
gets no new work for the time given, even as a probe, and a success does not lift that: it
is no failure of the call. Kept by node id apart from membership, so a worker that drops out
of one worker list and reappears is still distrusted. A backward pinned to it may still go
to it (the router's choice). It comes back ``away``: level with the most-loaded worker.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from agora_core import world
from agora_core.contract import Phase
from agora_core.schema import WorkerAnnouncement

THROUGHPUT_EMA = 0.2  # weight of the newest measurement
DEFAULT_THROUGHPUT = 10.0  # samples/s assumed for a worker nothing is known about yet


@dataclass(frozen=True)
class WorkerRef:
    """How to reach one worker: what a lane keeps to pin a sample's backward to it."""

    node_id: str
    address: str
    stage: int
    max_batch: int  # the most samples one request to it may carry (its announcement)


@dataclass(eq=False)
class CallToken:
    """One call in flight to a worker, and the most calls of ours it overlapped there."""

    node_id: str
    peak: int = 1


@dataclass(eq=False)
class _Entry:
    ref: WorkerRef
    vruntime: float
    throughput: float  # samples per second, measured end to end
    phase: Phase = Phase.SERVING
    banned_until: float = 0.0
    failed_at: float = 0.0  # the last failure, or the last probe of this banned worker
    seq: int = 0  # which heap entry is current (older ones are stale)
    dispatched: int = 0
    completed: int = 0
    active: set[CallToken] = field(default_factory=set)  # this trainer's calls to it, now
    failures: int = 0
    measured: bool = False
    away: bool = False  # invisible, banned or distrusted since last chosen: it enters level on return


def _never_gone(_node_id: str) -> bool:
    return False


@dataclass
class StageBalancer:
    stage: int
    ban_s: float = 10.0
    probe_s: float = 1.0  # with every worker banned: how often one of them is tried again
    gone: Callable[[str], bool] = _never_gone  # the DHT declared this node id dead (or left)
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _heap: list[tuple[float, int, str]] = field(default_factory=list)
    _counter: itertools.count = field(default_factory=itertools.count)
    bans: int = 0
    distrusts: int = 0
    _distrusted: dict[str, float] = field(default_factory=dict)  # node id -> until (monotonic)

    # --- membership ---------------------------------------------------------------------------

    def update(self, announcements: list[WorkerAnnouncement]) -> None:
        """Make the known workers exactly those announced (new ones enter at the max vruntime)."""
        seen = set()
        for ann in announcements:
            if ann.stage != self.stage:
                continue
            seen.add(ann.node_id)
            entry = self._entries.get(ann.node_id)
            if entry is None:
                level = max((e.vruntime for e in self._entries.values()), default=0.0)
                entry = _Entry(self._ref(ann), level, ann.throughput or self._typical())
                self._entries[ann.node_id] = entry
                self._push(entry)
            elif (entry.ref.address, entry.ref.max_batch) != (ann.address, ann.max_batch):
                entry.ref = self._ref(ann)  # restarted: same identity, new address or limit
            if not ann.phase.visible_to_trainers or self.distrusted(ann.node_id):
                entry.away = True
            entry.phase = ann.phase
        for node_id in [n for n in self._entries if n not in seen]:
            del self._entries[node_id]  # its heap entries go stale and are skipped

    def _ref(self, ann: WorkerAnnouncement) -> WorkerRef:
        return WorkerRef(ann.node_id, ann.address, self.stage, ann.max_batch)

    def largest_batch(self) -> int | None:
        """The most samples a request may carry to some usable worker now (None: no worker)."""
        return max((ref.max_batch for ref in self.workers), default=None)

    def _typical(self) -> float:
        known = [e.throughput for e in self._entries.values() if e.measured]
        return sorted(known)[len(known) // 2] if known else DEFAULT_THROUGHPUT

    def _push(self, entry: _Entry) -> None:
        entry.seq = next(self._counter)
        heapq.heappush(self._heap, (entry.vruntime, entry.seq, entry.ref.node_id))

    def visible(self, node_id: str) -> bool:
        """Known, visible to trainers in its phase, and not declared dead (banned or not)."""
        entry = self._entries.get(node_id)
        return entry is not None and entry.phase.visible_to_trainers and not self.gone(node_id)

    def usable(self, node_id: str, now: float | None = None) -> bool:
        now = world.monotonic() if now is None else now
        return (
            self.visible(node_id)
            and self._entries[node_id].banned_until <= now
            and self._distrusted.get(node_id, 0.0) <= now
        )

    def distrusted(self, node_id: str) -> bool:
        """Kept from new work by :meth:`distrust`, now."""
        return self._distrusted.get(node_id, 0.0) > world.monotonic()

    def banned(self, node_id: str) -> bool:
        entry = self._entries.get(node_id)
        return entry is not None and entry.banned_until > world.monotonic()

    def checkers(self, samples: int, exclude: frozenset[str] = frozenset()) -> list[WorkerRef]:
        """The workers a spot check may ask now: visible, not banned for a failed call, taking
        ``samples`` in one request; distrusted ones too (a check's output is never used, and a
        distrusted worker goes on being checked)."""
        now = world.monotonic()
        return [
            e.ref
            for node_id, e in self._entries.items()
            if node_id not in exclude
            and self.visible(node_id)
            and e.banned_until <= now
            and e.ref.max_batch >= samples
        ]

    @property
    def workers(self) -> list[WorkerRef]:
        now = world.monotonic()
        return [e.ref for e in self._entries.values() if self.usable(e.ref.node_id, now)]

    # --- dispatch ----------------------------------------------------------------------------

    def choose(self, samples: int = 1, exclude: frozenset[str] = frozenset()) -> WorkerRef | None:
        """The least-loaded usable worker that takes ``samples`` in one request, charged them up
        front; None if there is none."""
        now = world.monotonic()
        skipped: list[tuple[float, int, str]] = []
        chosen = None
        while self._heap:
            item = heapq.heappop(self._heap)
            entry = self._entries.get(item[2])
            if entry is None or entry.seq != item[1]:
                continue  # stale: the worker left, or it was re-pushed since
            ref = entry.ref
            if not self.usable(ref.node_id, now) or ref.node_id in exclude or ref.max_batch < samples:
                skipped.append(item)
                continue
            if entry.away:  # it comes into use now: level with the most-loaded, then choose again
                self._level(entry, now)
                continue
            chosen = entry
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        if chosen is None:
            chosen = self._probe(now, exclude, samples)
        if chosen is None:
            return None
        chosen.vruntime += samples / chosen.throughput
        chosen.dispatched += samples
        self._push(chosen)
        return chosen.ref

    def _level(self, entry: _Entry, now: float) -> None:
        others = [
            e.vruntime
            for node_id, e in self._entries.items()
            if e is not entry and not e.away and self.usable(node_id, now)
        ]
        entry.vruntime = max([entry.vruntime, *others])
        entry.away = False
        self._push(entry)

    def _probe(self, now: float, exclude: frozenset[str], samples: int) -> _Entry | None:
        """No worker is usable: the banned one that failed longest ago, if that was at least
        ``probe_s`` ago (then it counts as probed now), else None."""
        banned = [
            e
            for node_id, e in self._entries.items()
            if node_id not in exclude
            and self.visible(node_id)
            and e.banned_until > now
            and self._distrusted.get(node_id, 0.0) <= now
            and e.ref.max_batch >= samples
        ]
        entry = min(banned, key=lambda e: e.failed_at, default=None)
        if entry is None or now - entry.failed_at < self.probe_s:
            return None
        entry.failed_at = now
        return entry

    def begin(self, ref: WorkerRef) -> CallToken:
        """A call to ``ref`` starts. The token remembers the most calls of ours it overlapped."""
        token = CallToken(ref.node_id)
        entry = self._entries.get(ref.node_id)
        if entry is not None:
            entry.active.add(token)
            for active in entry.active:
                active.peak = max(active.peak, len(entry.active))
        return token

    def complete(self, token: CallToken, samples: int, seconds: float) -> None:
        """A call finished: fold the worker's observed throughput into its estimate."""
        entry = self._entries.get(token.node_id)
        if entry is None:
            return
        entry.active.discard(token)
        entry.completed += samples
        entry.banned_until = 0.0  # it answered: whatever failed before has passed
        if seconds <= 0:
            return
        # Little's law: the calls it served alongside this one, over this one's time.
        measured = samples * token.peak / seconds
        if entry.measured:
            measured = (1 - THROUGHPUT_EMA) * entry.throughput + THROUGHPUT_EMA * measured
        entry.throughput = measured
        entry.measured = True

    def fail(self, token: CallToken) -> None:
        """A call failed: keep its worker out of rotation for ``ban_s``."""
        entry = self._entries.get(token.node_id)
        if entry is not None:
            entry.active.discard(token)
            entry.failed_at = world.monotonic()
            entry.banned_until = entry.failed_at + self.ban_s
            entry.away = True
            entry.failures += 1
            self.bans += 1

    def distrust(self, node_id: str, seconds: float) -> None:
        """Choose ``node_id`` for nothing for ``seconds`` (not even as a probe), then bring it
        back level with the most-loaded worker."""
        if not seconds > 0:
            raise ValueError(f"a worker is distrusted for a positive time, not {seconds!r} s")
        now = world.monotonic()
        # Lapsed ones go: the map holds only exclusions in force, whatever ids come and go.
        self._distrusted = {n: until for n, until in self._distrusted.items() if until > now}
        self._distrusted[node_id] = max(self._distrusted.get(node_id, 0.0), now + seconds)
        entry = self._entries.get(node_id)
        if entry is not None:
            entry.away = True
        self.distrusts += 1

    def stats(self) -> dict[str, dict]:
        return {
            node_id: {
                "dispatched": e.dispatched,
                "completed": e.completed,
                "throughput": e.throughput,
                "vruntime": e.vruntime,
                "failures": e.failures,
            }
            for node_id, e in self._entries.items()
        }
