"""Stage progress: how a worker learns its stage's counts, and acts on the step decision.

Every worker publishes, under its own signed subkey of the stage's progress key, the step it
is at and the samples it accumulated toward it; it reads everyone's. When the samples of all
workers at its step reach the run's target batch size, or any worker already moved past that
step, it takes its own optimizer step. No worker waits for another: each decides from what
it last learned, and a worker that missed the moment catches up as soon as it sees a later
step.

Two channels carry the counts. The DHT report is the record: signed, read by joiners and
status tools, and the only way a worker learns who its peers are and where they listen. A
worker stores it when it changed and a second has passed (``DHT_INTERVAL_S``), or when its
refresh (a third of the report's lifetime) is due, and reads the stage's reports once a
second. Between those, pushes (``progress.poke`` with the counts) carry the news straight to
the peers: each worker sends its (step, samples) as they change (one push in flight, the
newest counts owed until it is answered) to the stage's collector, the live worker with the
lowest node id by the signed reports (the collector itself sends none); the worker whose
count completed the batch, usually the collector, sends its new step to every peer at once.
A push is counted only for a peer the signed reports show, and only while it is newer than
that peer's report and younger than a report refresh; a lost push, or a collector that died,
costs at most a second's lateness until the next DHT read (reports only ever understate a
count within a step, so a stale one makes a step late, never early). The main job's workers
step every fraction of a second: a store and a quorum read every 0.1 s tick for each of
them were half of what their event loops did, where one message carries the same news.

Only news is pushed, and only to who decides: each of R workers pushing every count to every
peer, and every worker its step, cost R x (R - 1) pushes per count and per step, the third
replica tripling the second's traffic for nothing. With a collector a count costs one push
and a step R - 1. A peer still answering the last push is owed the newest counts, sent when
it answers (one push in flight per peer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from agora_core import world
from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import REFRESHES_PER_TTL, OwnedEntry, check_refresh
from agora_core.errors import BadRequest, RpcError
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.schema import StageProgress, parse_entries, stage_progress_key
from agora_worker.progress.decision import decide_step, known_reports

log = get_logger("worker.progress")

# How often a worker reads the stage's reports and, at most, stores its own: a peer's push
# tells it sooner; this bounds how late it learns of a new peer, or of a step whose push was
# lost.
DHT_INTERVAL_S = 1.0


class StageProgressTracker:
    def __init__(
        self,
        *,
        dht: DhtNode,
        key: NodeKey,
        run_name: str,
        stage: int,
        target_batch_size: int,
        interval_s: float,
        ttl_s: float,
        local: Callable[[], tuple[int, int]],
        take_step: Callable[[], Awaitable[object]],
        address: Callable[[], str] = lambda: "",
        poke: Callable[[str, int, int], Awaitable[object]] | None = None,
    ):
        """``local()`` gives this worker's (step, accumulated samples); ``take_step()`` steps.
        With ``poke(address, step, samples)``, a worker pushes its counts to its peers at their
        ``address()`` as they change, and they hand theirs to :meth:`pushed`. Reports live
        ``ttl_s`` (the run's dht.record_ttl_s): a dead worker's lingers that long, which costs
        at most one early step, since only reports at a worker's own step count toward its
        batch."""
        check_refresh(interval_s, ttl_s, "progress_interval_s")
        self._key = key
        self._dht = dht
        self._entry = OwnedEntry(dht, key, stage_progress_key(run_name, stage))
        self._target = target_batch_size
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        self._refresh_s = max(interval_s, ttl_s / REFRESHES_PER_TTL)  # republishing an unchanged report
        self._dht_s = max(interval_s, min(DHT_INTERVAL_S, self._refresh_s))
        self._published: tuple | None = None  # (step, samples, address) of the last report
        self._published_at = -float("inf")
        self.publishes = 0  # reports stored (unchanged fresh ones are skipped)
        self._reports: list[StageProgress] = []  # the live peers' signed reports, as last read
        self._read_at = -float("inf")
        self._read_early = False  # a push came from a worker the last read did not show
        self._pushes: dict[str, tuple[int, int, float]] = {}  # peer -> (step, samples, when received)
        self._sent: tuple[int, int] | None = None  # the counts this worker last pushed
        self.pushes_sent = 0  # pushes of changed counts (to the collector, or a step to every peer)
        self._idle = False  # waiting out an idle tick: no samples toward the step
        self._local = local
        self._take_step = take_step
        self._address = address
        self._poke = poke
        self._peer_addresses: list[str] = []
        self._pokes: dict[str, asyncio.Task] = {}  # one push in flight per peer, held so the loop keeps it
        self._owed: set[str] = set()  # peers that were busy when counts were due: sent on their answer
        self.stage_samples = 0  # what the stage holds toward this worker's current step
        self.stage_step = 0  # the furthest of this worker's step and the others' reported ones
        self.last_ok = world.monotonic()  # when a read (with its due publish) last succeeded
        self.peers = 0
        self._others = 0  # the other workers' samples at this worker's step, as last known
        self.behind = False  # the last decision: a peer is past this worker's step
        self.ignored: dict[str, int] = {}  # peers whose step claims the last decision ignored
        self._wake = asyncio.Event()

    def decide(self, peers: list[StageProgress]) -> bool:
        """Whether to step now, given the peers' reports (:meth:`known`); keeps what the
        decision saw (``stage_samples``, ``stage_step``, ``behind``) for status and tests."""
        step, samples = self._local()
        decision = decide_step(step, samples, peers, self._target)
        self.peers = decision.peers
        self._others = decision.others
        self.stage_samples = decision.stage_samples
        self.stage_step = decision.stage_step
        self.behind = decision.behind
        claimed = {r.node_id: r.step for r in peers if r.node_id in decision.ignored}
        if claimed.keys() - self.ignored.keys():  # a claim newly too far ahead: said once
            log.warning("progress_claim_ignored", step=step, quorum_step=decision.quorum_step, claims=claimed)
        self.ignored = claimed
        return decision.step_now

    def known(self) -> list[StageProgress]:
        """The peers' reports as this worker knows them: each signed report, raised to the
        counts its worker pushed since, while the push is fresh."""
        return known_reports(self._reports, self._pushes, now=world.monotonic(), fresh_s=self._refresh_s)

    @property
    def reported(self) -> tuple[int, int] | None:
        """(step, samples) of the report this worker last stored (None before its first)."""
        return None if self._published is None else self._published[:2]

    @property
    def pending_samples(self) -> int:
        """This worker's samples that count toward its next step (0 in the sync phases)."""
        return self._local()[1]

    def poked(self) -> None:
        """A peer asked this worker to look now."""
        self._wake.set()

    def pushed(self, sender: str, step: int, samples: int) -> None:
        """Peer ``sender`` is at ``step`` with ``samples`` toward it. A sender the signed
        reports do not show yet is not counted (nor kept: anyone may claim any sender in an
        open run); it makes the next tick read the reports, which show it once it stored one."""
        if any(r.node_id == sender for r in self._reports):
            self._pushes[sender] = (step, samples, world.monotonic())
        else:
            self._read_early = True
        self._wake.set()

    def on_poke(self, meta: object, sender: str) -> None:
        """A ``progress.poke``: with ints ``step`` and ``samples``, a peer's push, from
        ``sender`` (authenticated in an authorized run; an open run's callers only declare who
        they are, as ``node``); without either, a request to look now. BadRequest otherwise."""
        meta = meta if isinstance(meta, dict) else {}
        step, samples = meta.get("step"), meta.get("samples")
        if step is None and samples is None:
            self.poked()
            return
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (step, samples)):
            raise BadRequest("progress.poke needs ints step >= 0 and samples >= 0")
        sender = sender or meta.get("node")
        if not isinstance(sender, str) or not sender:
            raise BadRequest("progress.poke with counts needs the sender's node id ('node')")
        self.pushed(sender, step, samples)

    def accumulated(self) -> None:
        """A backward just landed here. If the stage now holds a batch by what this worker
        knows, check at once instead of at the next tick: a step that waits for the tick takes
        in extra samples (fewer, larger steps than the schedule assumes). The new count goes to
        the collector at once: it may be the batch's last."""
        _step, samples = self._local()
        if samples + self._others >= self._target or self._idle:
            self._wake.set()  # the stage holds a batch, or this worker waits as an idle one
        self.push()

    async def _quiet_poke(self, address: str, step: int, samples: int) -> None:
        try:
            await self._poke(address, step, samples)
        except (RpcError, TimeoutError) as exc:  # a hint only: the peer's DHT read still comes
            log.debug("progress_poke_failed", address=address, error=str(exc))

    def collector(self) -> str | None:
        """The address this worker's counts go to: the live peer with the lowest node id, if
        that is lower than this worker's (None: this worker collects, or knows no peer)."""
        lowest = min(self._reports, key=lambda r: r.node_id, default=None)
        if lowest is None or lowest.node_id > self._key.node_id or not lowest.address:
            return None
        return lowest.address

    def push(self, *, force: bool = False) -> None:
        """Send this worker's counts to the collector if they changed and hold samples;
        ``force`` (a step this worker completed): its new step to every peer. A peer still
        answering the last push is owed these counts: they go when it answers, so pushes are
        paced by the peer's answers, not by a timer that would make the batch's last count late."""
        counts = self._local()
        if self._poke is None or counts == self._sent or (not force and counts[1] == 0):
            return
        collector = None if force else self.collector()
        recipients = self._peer_addresses if force else [collector] if collector else []
        if not recipients:
            return
        self._sent = counts
        self.pushes_sent += 1
        for address in recipients:
            if address in self._pokes:
                self._owed.add(address)
            else:
                self._send(address, counts)

    def _send(self, address: str, counts: tuple[int, int]) -> None:
        task = asyncio.get_running_loop().create_task(self._quiet_poke(address, *counts))
        self._pokes[address] = task
        task.add_done_callback(lambda done, a=address: self._answered(a, done))

    def _answered(self, address: str, done: asyncio.Task) -> None:
        """A push to ``address`` finished: send what it is owed (the counts last pushed),
        unless the push was cancelled (the worker is stopping)."""
        self._pokes.pop(address, None)
        owed = address in self._owed
        self._owed.discard(address)
        if owed and not done.cancelled() and self._sent is not None and address in self._peer_addresses:
            self._send(address, self._sent)

    async def publish(self) -> None:
        """Store this worker's report when it changed and a DHT interval has passed, or when
        its refresh is due."""
        step, samples = self._local()
        address = self._address()
        since = world.monotonic() - self._published_at
        if since < self._dht_s or (self._published == (step, samples, address) and since < self._refresh_s):
            return
        report = StageProgress(node_id=self._key.node_id, step=step, samples=samples, address=address)
        await self._entry.publish(report.to_value(), self._ttl_s)
        self._published, self._published_at = (step, samples, address), world.monotonic()
        self.publishes += 1

    async def read(self) -> list[StageProgress]:
        """The reports of the stage's live workers (a crashed one's report outlives it)."""
        reports = parse_entries(await self._entry.read_all(), StageProgress.from_value)
        live = self._dht.live_ids()
        return [r for r in reports if r.node_id in live]

    async def _refresh(self) -> None:
        """Store this worker's report and read the stage's, each when due (both in one round
        trip: decide() takes this worker's own counts from local(), not from the read). A
        push from an unknown peer brings the read forward, to at most one a tick."""
        since = world.monotonic() - self._read_at
        if since < self._dht_s and not (self._read_early and since >= self._interval_s):
            await self.publish()
            return
        _, reports = await asyncio.gather(self.publish(), self.read())
        self._read_at = self.last_ok = world.monotonic()
        self._read_early = False
        # Its own report is left out: local() is the truth, and a restarted worker with the
        # same key may still read its previous life's report.
        self._reports = [r for r in reports if r.node_id != self._key.node_id]
        self._peer_addresses = [r.address for r in self._reports if r.address]
        live = {r.node_id for r in self._reports}
        self._pushes = {node: counts for node, counts in self._pushes.items() if node in live}

    async def run(self) -> None:
        """Refresh, push, decide, every ``interval_s`` or when woken, until cancelled."""
        while True:
            try:
                await self._refresh()
                self.push()
                if self.decide(self.known()):
                    completed = not self.behind
                    await self._take_step()
                    if completed:
                        self.push(force=True)  # tell the others at once: they may be waiting on it
                    continue
            except (DhtError, RpcError) as exc:
                log.warning("progress_unavailable", error=str(exc))
            self._idle = self._local()[1] == 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._dht_s if self._idle else self._interval_s):
                    await self._wake.wait()
            self._wake.clear()
            self._idle = False
