"""Stage progress: the workers of a stage step together once they jointly hold a batch.

Every worker publishes, under its own signed subkey of the stage's progress key, the step it
is at and the samples it accumulated toward it; it reads everyone's. When the samples of all
workers at its step reach the run's target batch size, or any worker already moved past that
step, it takes its own optimizer step. No worker waits for another: each decides from what
the DHT shows, and a worker that missed the moment catches up as soon as it sees a later step.

A worker holding no samples toward its step has little to decide: it looks once a second
(``IDLE_INTERVAL_S``) or when woken -- by a peer's poke after a step, or by the first backward
that lands -- and any worker republishes its report only when the report changed or its
refresh (a third of the report's lifetime) is due. An idle stage so costs a read per worker a
second and a signed store every few seconds, instead of ten of each a second (the main job's
progress interval is 0.1 s).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from agora_core import world
from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import REFRESHES_PER_TTL, OwnedEntry, check_refresh
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.logs import get_logger
from agora_core.schema import StageProgress, parse_entries, stage_progress_key

log = get_logger("worker.progress")

# How often a worker with no samples toward its step looks: a peer that stepped pokes it at
# once; this bounds how late it notices when a poke was lost.
IDLE_INTERVAL_S = 1.0


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
        poke: Callable[[str], Awaitable[object]] | None = None,
    ):
        """``local()`` gives this worker's (step, accumulated samples); ``take_step()`` steps.
        With ``poke(address)``, a worker that steps pokes its peers at their ``address()``, so
        they check at once instead of at their next tick. Reports live ``ttl_s`` (the run's
        dht.record_ttl_s): a dead worker's lingers that long, which costs at most one early
        step, since only reports at a worker's own step count toward its batch."""
        check_refresh(interval_s, ttl_s, "progress_interval_s")
        self._key = key
        self._dht = dht
        self._entry = OwnedEntry(dht, key, stage_progress_key(run_name, stage))
        self._target = target_batch_size
        self._interval_s = interval_s
        self._ttl_s = ttl_s
        self._refresh_s = max(interval_s, ttl_s / REFRESHES_PER_TTL)  # republishing an unchanged report
        self._idle_s = max(interval_s, min(IDLE_INTERVAL_S, self._refresh_s))
        self._published: tuple | None = None  # (step, samples, address) of the last report
        self._published_at = 0.0
        self.publishes = 0  # reports stored (unchanged fresh ones are skipped)
        self._idle = False  # waiting out an idle tick: no samples toward the step
        self._local = local
        self._take_step = take_step
        self._address = address
        self._poke = poke
        self._peer_addresses: list[str] = []
        self._pokes: set[asyncio.Task] = set()  # held so the loop does not drop them mid-flight
        self.stage_samples = 0  # what the stage holds toward this worker's current step
        self.stage_step = 0  # the furthest of this worker's step and the others' reported ones
        self.last_ok = world.monotonic()  # when a publish and read last both succeeded
        self.peers = 0
        self._others = 0  # the other workers' samples at this worker's step, as last read
        self._wake = asyncio.Event()

    def decide(self, reports: list[StageProgress]) -> bool:
        """Whether to step now, given the stage's reports (this worker's own included)."""
        step, samples = self._local()
        at_step = [r for r in reports if r.step == step and r.node_id != self._key.node_id]
        self._peer_addresses = [r.address for r in reports if r.node_id != self._key.node_id and r.address]
        self.peers = len(at_step)
        self._others = sum(r.samples for r in at_step)
        self.stage_samples = samples + self._others
        # Its own report is ignored: local() is the truth, and a restarted worker with the same
        # key may still read its previous life's report.
        self.stage_step = max([step, *(r.step for r in reports if r.node_id != self._key.node_id)])
        behind = self.stage_step > step
        return behind or (samples > 0 and self.stage_samples >= self._target)

    @property
    def reported(self) -> tuple[int, int] | None:
        """(step, samples) of the report this worker last stored (None before its first)."""
        return None if self._published is None else self._published[:2]

    @property
    def pending_samples(self) -> int:
        """This worker's samples that count toward its next step (0 in the sync phases)."""
        return self._local()[1]

    def poked(self) -> None:
        """A peer stepped: look now."""
        self._wake.set()

    def accumulated(self) -> None:
        """A backward just landed here. If the stage now holds a batch by the last reading,
        check at once instead of at the next tick: a step that waits for the tick takes in
        extra samples (fewer, larger steps than the schedule assumes)."""
        _step, samples = self._local()
        if samples + self._others >= self._target or self._idle:
            self._wake.set()  # the stage holds a batch, or this worker waits as an idle one

    async def _quiet_poke(self, address: str) -> None:
        try:
            await self._poke(address)
        except (RpcError, TimeoutError) as exc:  # a hint only: the peer's tick still comes
            log.debug("progress_poke_failed", address=address, error=str(exc))

    async def publish(self) -> None:
        """Store this worker's report unless the stored one says the same and is still fresh."""
        step, samples = self._local()
        address = self._address()
        now = world.monotonic()
        if self._published == (step, samples, address) and now - self._published_at < self._refresh_s:
            return
        report = StageProgress(node_id=self._key.node_id, step=step, samples=samples, address=address)
        await self._entry.publish(report.to_value(), self._ttl_s)
        self._published, self._published_at = (step, samples, address), now
        self.publishes += 1

    async def read(self) -> list[StageProgress]:
        """The reports of the stage's live workers (a crashed one's report outlives it)."""
        reports = parse_entries(await self._entry.read_all(), StageProgress.from_value)
        live = self._dht.live_ids()
        return [r for r in reports if r.node_id in live]

    async def run(self) -> None:
        """Publish, read, decide, every ``interval_s``, until cancelled."""
        while True:
            try:
                # decide() takes this worker's own counts from local(), so the read need not
                # wait for the publish: both in one round trip
                _, reports = await asyncio.gather(self.publish(), self.read())
                self.last_ok = world.monotonic()
                if self.decide(reports):
                    await self._take_step()
                    await self.publish()  # tell the others at once: they may be waiting on it
                    if self._poke is not None:  # samples they take before looking miss the step
                        for address in self._peer_addresses:
                            task = asyncio.get_running_loop().create_task(self._quiet_poke(address))
                            self._pokes.add(task)
                            task.add_done_callback(self._pokes.discard)
                    continue
            except (DhtError, RpcError) as exc:
                log.warning("progress_unavailable", error=str(exc))
            self._idle = self._local()[1] == 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._idle_s if self._idle else self._interval_s):
                    await self._wake.wait()
            self._wake.clear()
            self._idle = False
