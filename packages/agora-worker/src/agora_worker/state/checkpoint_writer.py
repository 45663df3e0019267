"""When a worker writes its checkpoints: every ``checkpoint.every_steps`` steps, and once more
when it stops cleanly, each in the background so serving and training never wait on the disk.

The snapshot is captured on the compute thread (a copy, under the optimizer's lock), queued
there the moment the step is due so it holds exactly that step, then hashed and written on a
worker thread. The worker's standing (its sync phase and averaging rounds while serving) is
read at that same moment and recorded in the manifest, so it describes the state captured.
One write at a time: a step that comes due while the previous write is still going is
skipped, with a log line. A failed write is logged and counted, never fatal: the previous
checkpoints are still there.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable

from agora_core import world
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_worker.state.checkpoint import CheckpointStore
from agora_worker.state.snapshot import StateSnapshot

log = get_logger("worker.checkpoint")


class CheckpointWriter:
    def __init__(
        self,
        store: CheckpointStore,
        *,
        capture: Callable[[], concurrent.futures.Future[StateSnapshot]],
        every_steps: int,
        metrics: NodeMetrics,
        standing: Callable[[], dict] | None = None,
    ):
        """``capture()`` queues a snapshot of the replica on its compute thread (``Runtime.call``);
        ``standing()``, called on the event loop as each capture is queued, says where the
        worker stands then: {"phase": its sync phase, "serving_rounds": averaging rounds it
        completed since it began serving} (``CheckpointStore.save``)."""
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.store = store
        self.every_steps = every_steps
        self._capture = capture
        self._standing = standing
        self._task: asyncio.Task | None = None
        self.last_step: int | None = None  # the step of the newest checkpoint written or resumed
        self.resumed_step: int | None = None  # the checkpoint's step the worker started from
        self._m_step = metrics.gauge("agora_worker_checkpoint_step", "Step of the newest checkpoint.")
        self._m_written = metrics.counter("agora_worker_checkpoints_total", "Checkpoints written.")
        self._m_seconds = metrics.gauge(
            "agora_worker_checkpoint_seconds", "Seconds the last checkpoint took, capture to rename."
        )
        self._m_failed = metrics.counter(
            "agora_worker_checkpoint_failures_total", "Checkpoint writes that failed."
        )

    @property
    def writing(self) -> bool:
        return self._task is not None and not self._task.done()

    def resumed(self, step: int) -> None:
        """The replica was restored from the checkpoint of ``step``."""
        self.last_step = self.resumed_step = step
        self._m_step.set(step)

    def info(self) -> dict:
        """For worker.info."""
        return {
            "directory": str(self.store.directory),
            "last_step": self.last_step,
            "resumed_step": self.resumed_step,
            "writing": self.writing,
        }

    def on_step(self, step: int) -> None:
        """After every optimizer step: start a write when ``step`` is due."""
        if step % self.every_steps:
            return
        if self.writing:
            log.warning(
                "checkpoint_skipped_busy", step=step, reason="the previous checkpoint is still writing"
            )
            return
        queued = self._queue()  # now, before the next batch or step
        self._task = asyncio.get_running_loop().create_task(self._write(*queued), name="worker-checkpoint")

    async def write(self) -> StateSnapshot | None:
        """Write one checkpoint of a snapshot captured now; None if it failed (logged and counted)."""
        return await self._write(*self._queue())

    def _queue(self) -> tuple[concurrent.futures.Future[StateSnapshot], dict | None, float]:
        """A capture queued now, the worker's standing now, and when."""
        return self._capture(), self._standing() if self._standing else None, world.monotonic()

    async def _write(
        self, captured: concurrent.futures.Future[StateSnapshot], standing: dict | None, started: float
    ) -> StateSnapshot | None:
        try:
            snapshot = await asyncio.wrap_future(captured)
            await world.offload(self.store.save, snapshot, standing=standing)
        except Exception as exc:  # whatever went wrong (a full disk, a bug): training goes on
            self._m_failed.inc()
            log.error("checkpoint_failed", directory=str(self.store.directory), error=repr(exc))
            return None
        self.last_step = snapshot.step
        self._m_step.set(snapshot.step)
        self._m_written.inc()  # the store logged checkpoint_saved
        self._m_seconds.set(world.monotonic() - started)
        return snapshot

    async def close(self, *, step: int, timeout_s: float) -> None:
        """On a clean stop, the replica at ``step``: let a running write finish, then write a
        last checkpoint unless the newest one already is of this step (or nothing was trained).
        Gives up after ``timeout_s``: a write cut short leaves the previous checkpoints valid."""
        try:
            async with asyncio.timeout(timeout_s):
                if self._task is not None:
                    await asyncio.gather(self._task, return_exceptions=True)
                    self._task = None
                if step > 0 and step != self.last_step:
                    await self.write()
        except TimeoutError:
            self._m_failed.inc()
            log.error(
                "checkpoint_failed", directory=str(self.store.directory), error=f"stop: over {timeout_s:g} s"
            )
