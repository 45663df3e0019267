"""Stage progress: the workers of a stage step together once they jointly hold a batch.

Every worker publishes, under its own signed subkey of the stage's progress key, the step it
is at and the samples it accumulated toward it; it reads everyone's. When the samples of all
workers at its step reach the run's target batch size, or any worker already moved past that
step, it takes its own optimizer step. No worker waits for another: each decides from what
the DHT shows, and a worker that missed the moment catches up as soon as it sees a later step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.logs import get_logger
from agora_core.schema import StageProgress, stage_progress_key

log = get_logger("worker.progress")


class StageProgressTracker:
    def __init__(
        self,
        *,
        dht: DhtNode,
        key: NodeKey,
        run: str,
        stage: int,
        target_batch_size: int,
        interval_s: float,
        local: Callable[[], tuple[int, int]],
        take_step: Callable[[], Awaitable[object]],
    ):
        """``local()`` gives this worker's (step, accumulated samples); ``take_step()`` steps."""
        self._key = key
        self._entry = OwnedEntry(dht, key, stage_progress_key(run, stage))
        self._target = target_batch_size
        self._interval_s = interval_s
        self._local = local
        self._take_step = take_step
        self.stage_samples = 0  # what the stage holds toward this worker's current step
        self.peers = 0

    def decide(self, reports: list[StageProgress]) -> bool:
        """Whether to step now, given the stage's reports (this worker's own included)."""
        step, samples = self._local()
        at_step = [r for r in reports if r.step == step and r.node_id != self._key.node_id]
        self.peers = len(at_step)
        self.stage_samples = samples + sum(r.samples for r in at_step)
        behind = any(r.step > step for r in reports)
        return behind or (samples > 0 and self.stage_samples >= self._target)

    async def publish(self) -> None:
        step, samples = self._local()
        report = StageProgress(node_id=self._key.node_id, step=step, samples=samples)
        await self._entry.publish(report.to_value(), max(10 * self._interval_s, 5.0))

    async def read(self) -> list[StageProgress]:
        reports = []
        for value in (await self._entry.read_all()).values():
            try:
                reports.append(StageProgress.from_value(value.value))
            except Exception:
                continue  # a malformed report: ignore it, the writer's own validators should have
        return reports

    async def run(self) -> None:
        """Publish, read, decide, every ``interval_s``, until cancelled."""
        while True:
            try:
                await self.publish()
                if self.decide(await self.read()):
                    await self._take_step()
                    await self.publish()  # tell the others at once: they may be waiting on it
                    continue
            except (DhtError, RpcError) as exc:
                log.warning("progress_unavailable", error=str(exc))
            await asyncio.sleep(self._interval_s)
