"""The worker's compute loop: two queues, batch coalescing, one compute thread.

Connection handlers put each request on the forward or the backward queue. The compute thread
always serves the queue whose oldest request is older, merges the requests waiting in that
queue (same op, same sequence length; a backward, the same weights to recompute under) into
one microbatch up to the configured maximum samples and tokens, runs it, and hands each caller
its own slice of the result. A microbatch takes at most half of the samples that wait for it
(but ``min_batch_samples`` when that many wait): a stage that swept its whole queue into one
batch would send every lane downstream in one wave, the next stage would batch that wave whole
again, and the pipeline would move in convoys that leave its slowest stage idle while a wave
is away (benchmarks/pipeline.py measures the bottleneck's busy share). If a merged batch
fails, its requests are retried one by one, so a poisoned request fails alone. A batch that
runs out of device memory is split in halves and each half run (again split if need be); the
coalescing limits come down to the half that is tried next. Gradients and samples of the
attempt that ran out count nowhere (``HostOptimizer.accumulating``), so every sample counts
once.
Control work (an optimizer step) runs on the same thread between batches, so weights never
change under a running batch.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agora_core import world
from agora_core.injection import Slowdown
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_worker.serving.backend import StageBackend
from agora_worker.serving.tensors import split_samples
from agora_worker.serving.versions import LIVE

log = get_logger("worker.runtime")

VERSION = "version"  # a forward's result: the name of the weights it ran under

IDLE_WAIT_S = 0.5  # the compute thread re-checks for shutdown at least this often
# A pair still shares the per-batch cost; with 4 the bottleneck of benchmarks/pipeline.py
# dipped to 0.89-0.92 busy at 8 lanes (its stages' batches regrouped into waves of 4).
MIN_BATCH_SAMPLES = 2


class Op(enum.StrEnum):
    """What a queued request asks the stage to compute."""

    FORWARD = "forward"  # head/body: the output boundary
    EVALUATE = "evaluate"  # tail: per-sample losses, no training
    BACKWARD = "backward"  # head/body: recompute, backpropagate, accumulate
    FORWARD_BACKWARD = "forward_backward"  # tail: loss and input gradient in one pass
    GRADIENT = "gradient"  # body/tail: the input gradient (tail: and losses), no training

    @property
    def queue(self) -> str:
        """The queue it waits in: forward work or backward (training) work."""
        return "forward" if self in (Op.FORWARD, Op.EVALUATE, Op.GRADIENT) else "backward"


@dataclass(eq=False)
class Task:
    op: Op
    inputs: dict[str, np.ndarray]  # tokens (B, T) and, by op, boundary, grad, labels
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(
        default_factory=lambda: world.monotonic()
    )  # read late: the world may be simulated
    cancelled: bool = False
    version: int | None = None  # a backward: the weight version its forward ran under
    weights: int = LIVE  # a backward: the weights it recomputes under (set as its batch forms)

    def joins(self, first: Task) -> bool:
        """Whether it may share ``first``'s microbatch: one op, length and weights."""
        return self.op == first.op and self.length == first.length and self.weights == first.weights

    @property
    def samples(self) -> int:
        return self.inputs["tokens"].shape[0]

    @property
    def length(self) -> int:
        return self.inputs["tokens"].shape[1]


def _settle(answers: list[tuple[asyncio.Future, Any, BaseException | None]]) -> None:
    for future, result, error in answers:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class Runtime:
    def __init__(
        self,
        backend: StageBackend,
        *,
        max_batch_samples: int,
        max_batch_tokens: int,
        min_batch_samples: int = MIN_BATCH_SAMPLES,
        metrics: NodeMetrics | None = None,
        slowdown: Slowdown | None = None,
    ):
        """``min_batch_samples``: a microbatch may take these many of the samples waiting even
        where that is more than half of them; ``slowdown``: an injected one
        (``agora_core.injection``) stretches every batch."""
        if max_batch_samples < 1 or max_batch_tokens < 1 or min_batch_samples < 1:
            raise ValueError("min_batch_samples, max_batch_samples and max_batch_tokens must be >= 1")
        self.backend = backend
        self.slowdown = slowdown or Slowdown()
        self.min_batch_samples = min_batch_samples
        self.max_batch_samples = max_batch_samples
        self.max_batch_tokens = max_batch_tokens
        self._forward: collections.deque[Task] = collections.deque()
        self._backward: collections.deque[Task] = collections.deque()
        self._controls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._lane: asyncio.Task | None = None  # the compute task in a simulation (no thread)
        self._work = asyncio.Event()  # set when work arrives for the simulated lane
        self._stopping = False
        self.samples_processed = 0
        self.samples_by_op: collections.Counter[Op] = collections.Counter()
        self.compute_seconds = 0.0
        # Requests that failed alone (after their merged batch was split), and how many of them
        # in a row with no successful batch between: a device that fails everything (the
        # self-termination rule reads it).
        self.failed_requests = 0
        self.failures_in_a_row = 0
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=1024)  # recent, for tests/tools
        self.oom_splits = 0  # microbatches split in halves because device memory ran out
        metrics = metrics or NodeMetrics(role="worker")
        self._m_wait = metrics.histogram(
            "agora_worker_queue_wait_seconds", "Time requests wait in a queue.", ["queue"]
        )
        self._m_compute = metrics.histogram(
            "agora_worker_compute_seconds", "Compute time per microbatch, by op.", ["op"]
        )
        self._m_batch = metrics.histogram(
            "agora_worker_batch_samples",
            "Samples per coalesced microbatch.",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        )
        self._m_samples = metrics.counter("agora_worker_samples_total", "Samples computed, by op.", ["op"])
        # the labelled children, each looked up once (on first use, so a series appears only
        # once it has samples): .labels() is a lock and a dict walk on the compute thread
        self._m_children: dict[Op, tuple] = {}
        metrics.counter_from(
            "agora_worker_oom_splits_total",
            "Microbatches split in halves after running out of device memory.",
            (),
            lambda: {(): float(self.oom_splits)},
        )

    # --- the event loop's side -------------------------------------------------------------------

    def start(self) -> None:
        if world.simulated():  # no thread outside virtual time: a task on the loop computes
            self._lane = asyncio.get_running_loop().create_task(
                self._run_in_virtual_time(), name="agora-compute"
            )
            return
        self._thread = threading.Thread(target=self._run, name="agora-compute", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._work.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    @property
    def queued_samples(self) -> int:
        with self._cond:
            return sum(t.samples for t in self._forward) + sum(t.samples for t in self._backward)

    async def submit(
        self, op: Op, inputs: dict[str, np.ndarray], *, version: int | None = None
    ) -> dict[str, Any]:
        """Queue a request (checked numpy inputs) and wait for its share of the result, as
        numpy arrays (a forward's also names its weight version: ``VERSION``, which a backward
        passes back as ``version``). Cancelling the wait (the caller's deadline) drops the
        request if it has not started."""
        loop = asyncio.get_running_loop()
        task = Task(op, inputs, loop.create_future(), loop, version=version)
        with self._cond:
            (self._forward if op.queue == "forward" else self._backward).append(task)
            self._cond.notify()
        self._work.set()
        try:
            return await task.future
        finally:
            task.cancelled = True

    def call(self, work: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``work`` on the compute thread before the next batch (an optimizer step)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._controls.append((work, future))
            self._cond.notify()
        self._work.set()
        return future

    # --- the compute thread -----------------------------------------------------------------------

    def _next(self) -> tuple[str, Any] | None:
        """Under the lock: the next control or batch, or None when there is nothing to do."""
        if self._controls:
            return "control", self._controls.popleft()
        for queue in (self._forward, self._backward):
            while queue and queue[0].cancelled:
                queue.popleft()
        heads = [q for q in (self._forward, self._backward) if q]
        if not heads:
            return None
        queue = min(heads, key=lambda q: q[0].enqueued)  # the older request goes first
        if queue is self._backward:  # which weights each recomputes under, as of now
            for task, weights in zip(
                queue, self.backend.weights_of_each([t.version for t in queue]), strict=True
            ):
                task.weights = weights
        first = queue.popleft()
        alike = first.samples + sum(t.samples for t in queue if t.joins(first) and not t.cancelled)
        most = min(self.max_batch_samples, max(self.min_batch_samples, (alike + 1) // 2))
        batch, samples, tokens = [first], first.samples, first.samples * first.length
        kept: collections.deque[Task] = collections.deque()
        while queue:
            task = queue.popleft()
            fits = (
                task.joins(first)
                and samples + task.samples <= most
                and tokens + task.samples * task.length <= self.max_batch_tokens
            )
            if task.cancelled:
                continue
            if fits:
                batch.append(task)
                samples += task.samples
                tokens += task.samples * task.length
            else:
                kept.append(task)
        queue.extend(kept)  # order kept: they are the next batch's candidates
        return "batch", batch

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next()
                while item is None and not self._stopping:
                    self._cond.wait(IDLE_WAIT_S)
                    item = self._next()
                if item is None:
                    return  # stopping, and nothing left to do
            what, payload = item
            if what == "control":
                self._run_control(*payload)
            else:
                self._deliver(self._run_batch(payload))

    async def _run_in_virtual_time(self) -> None:
        """The compute thread's loop as a task of a simulation: the same batches, their compute
        time (what the stage held, ``world.hold``) waited out in virtual time before the
        answers go back."""
        while True:
            self._work.clear()
            with self._cond:
                item = self._next()
            if item is None:
                if self._stopping:
                    return
                await self._work.wait()
                continue
            what, payload = item
            world.take_held()  # what anything else held before: not this lane's
            if what == "control":
                self._run_control(*payload)
                await asyncio.sleep(world.take_held())
            else:
                answers = self._run_batch(payload)
                held = world.take_held()
                held += self.slowdown.extra_s(held)  # an injected slow device too
                self.compute_seconds += held
                await asyncio.sleep(held)
                self._deliver(answers)

    @staticmethod
    def _run_control(work: Callable[[], Any], future: concurrent.futures.Future) -> None:
        try:
            result, error = work(), None
        except BaseException as exc:  # reported to whoever asked for the work
            result, error = None, exc
        # The asker may have given up meanwhile (a stopping worker cancels its step's wait):
        # the work ran, nobody takes its answer, and the compute thread must live on.
        with contextlib.suppress(concurrent.futures.InvalidStateError):
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _run_batch(self, batch: list[Task]) -> list[tuple[Task, Any, BaseException | None]]:
        """Compute one batch; returns each task's answer (result or error), to deliver."""
        started = world.monotonic()
        wait, compute, counted = self._children(batch[0].op)  # a batch holds one op
        for task in batch:
            wait.observe(started - task.enqueued)
        try:
            results = self._compute(batch)
        except Exception as exc:
            if len(batch) == 1:
                self.failed_requests += 1
                self.failures_in_a_row += 1
                log.warning("request_failed", op=batch[0].op, error=f"{type(exc).__name__}: {exc}")
                return [(batch[0], None, exc)]
            # find the poisoned request: the others still get answers
            return [answer for task in batch for answer in self._run_batch([task])]
        if self.slowdown.factor != 1.0:  # an injected slow device: the batch takes factor x as long
            world.hold(self.slowdown.extra_s(world.monotonic() - started))
        elapsed = world.monotonic() - started
        self.failures_in_a_row = 0
        samples = sum(task.samples for task in batch)
        self.samples_processed += samples
        self.samples_by_op[batch[0].op] += samples
        self.compute_seconds += elapsed
        self.batch_sizes.append(samples)
        compute.observe(elapsed)
        self._m_batch.observe(samples)
        counted.inc(samples)
        return [(task, result, None) for task, result in zip(batch, results, strict=True)]

    def _children(self, op: Op) -> tuple:
        children = self._m_children.get(op)
        if children is None:
            children = self._m_children[op] = (
                self._m_wait.labels(queue=op.queue),
                self._m_compute.labels(op=op),
                self._m_samples.labels(op=op),
            )
        return children

    def _compute(self, batch: list[Task]) -> list[dict[str, np.ndarray]]:
        names = batch[0].inputs.keys()
        merged = {
            name: torch.from_numpy(np.concatenate([task.inputs[name] for task in batch])) for name in names
        }
        op = batch[0].op
        named = {VERSION: self.backend.mark_version()} if op == Op.FORWARD else {}
        versions = [task.version for task in batch for _ in range(task.samples)]  # per sample
        outputs = self._compute_samples(op, merged, versions)
        bounds = np.cumsum([task.samples for task in batch])[:-1]
        split = {name: split_samples(tensor, bounds) for name, tensor in outputs.items()}
        return [{**{name: parts[i] for name, parts in split.items()}, **named} for i in range(len(batch))]

    def _compute_samples(
        self, op: Op, inputs: dict[str, torch.Tensor], versions: list[int | None]
    ) -> dict[str, torch.Tensor]:
        """Run ``op`` on merged inputs (B, ...), ``versions`` naming each sample's forward's
        weights; out of device memory, on each half in turn."""
        try:
            return self._run_op(op, inputs, versions)
        except torch.cuda.OutOfMemoryError:
            samples = inputs["tokens"].shape[0]
            if samples == 1:
                raise
        half = (samples + 1) // 2
        self._lower_limits(samples, half, inputs["tokens"].shape[1])
        first = self._compute_samples(op, {name: t[:half] for name, t in inputs.items()}, versions[:half])
        second = self._compute_samples(op, {name: t[half:] for name, t in inputs.items()}, versions[half:])
        return {name: torch.cat([first[name], second[name]]) for name in first}

    def _lower_limits(self, samples: int, half: int, length: int) -> None:
        self.oom_splits += 1
        self.max_batch_samples = min(self.max_batch_samples, half)
        self.max_batch_tokens = min(self.max_batch_tokens, half * length)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the failed attempt's blocks, back for the halves
        log.warning(
            "microbatch_split_out_of_memory",
            samples=samples,
            max_batch_samples=self.max_batch_samples,
            max_batch_tokens=self.max_batch_tokens,
        )

    def _run_op(
        self, op: Op, merged: dict[str, torch.Tensor], versions: list[int | None]
    ) -> dict[str, torch.Tensor]:
        backend = self.backend
        if op == Op.FORWARD:
            return {"boundary": backend.forward(merged["tokens"], merged.get("boundary"))}
        if op == Op.EVALUATE:
            return {"loss": backend.evaluate(merged["tokens"], merged["boundary"], merged["labels"])}
        if op == Op.BACKWARD:
            grad = backend.backward(
                merged["tokens"], merged.get("boundary"), merged["grad"], versions=versions
            )
            return {} if grad is None else {"grad": grad}
        if op == Op.GRADIENT:
            return backend.gradient(
                merged["tokens"], merged["boundary"], grad=merged.get("grad"), labels=merged.get("labels")
            )
        loss, grad = backend.forward_backward(merged["tokens"], merged["boundary"], merged["labels"])
        return {"loss": loss, "grad": grad}

    @staticmethod
    def _deliver(answered: list[tuple[Task, Any, BaseException | None]]) -> None:
        """Results or errors, one wake-up per event loop for all of them: each
        ``call_soon_threadsafe`` writes to the loop's self-pipe, and that write hands the GIL to
        the woken loop, so one per request made the compute thread wait for the loop each time."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for task, result, error in answered:
            by_loop.setdefault(task.loop, []).append((task.future, result, error))
        for loop, answers in by_loop.items():
            if not loop.is_closed():
                loop.call_soon_threadsafe(_settle, answers)
