"""The compute loop: older queue first, coalescing, a poisoned request failing alone."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from agora_devkit.processes import wait_until_async
from agora_worker.serving.runtime import VERSION, Op, Runtime


class GatedBackend:
    """Records the batches it runs; the first batch waits until the test opens the gate."""

    def __init__(self):
        self.gate = threading.Event()
        self.started = threading.Event()
        self.batches: list[tuple[str, int]] = []
        self.lengths: list[int] = []  # each batch's sequence length
        self.versions: list[list[int | None]] = []  # each backward batch's per-sample versions
        self.kept = {7, 8}  # versions whose weights are kept apart; any other name: the live ones
        self.marked = 0

    def _run(self, op: str, tokens: torch.Tensor) -> None:
        self.batches.append((op, tokens.shape[0]))
        self.lengths.append(tokens.shape[1])
        self.started.set()
        if not self.gate.wait(timeout=30):
            raise TimeoutError("the test never opened the gate")
        if bool((tokens == 13).any()):
            raise RuntimeError("poisoned sample")

    def forward(self, tokens, boundary):
        self._run("forward", tokens)
        return boundary * 2

    def mark_version(self) -> int:
        self.marked += 1
        return 100 + self.marked

    def weights_of_each(self, versions):
        return [version if version in self.kept else 0 for version in versions]

    def backward(self, tokens, boundary, grad, *, versions=None):
        self.versions.append(versions)
        self._run("backward", tokens)
        return grad * 3


def sample(value: int, t: int = 4) -> dict[str, np.ndarray]:
    return {"tokens": np.full((1, t), value), "boundary": np.full((1, t, 2), float(value), dtype=np.float32)}


@pytest.fixture
def runtime():
    backend = GatedBackend()
    rt = Runtime(backend, max_batch_samples=8, max_batch_tokens=1000)
    rt.start()
    yield rt, backend
    backend.gate.set()
    rt.stop()


async def test_waiting_requests_are_merged_and_each_caller_gets_its_own_slice(runtime, monkeypatch):
    rt, backend = runtime
    loop = asyncio.get_running_loop()
    wakes = []  # the threads that woke this loop
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        wakes.append(threading.current_thread().name)
        return original(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    first = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(backend.started.is_set, what="the first batch to start")
    values = [v for v in range(2, 23) if v != 13]  # 13 poisons a batch
    rest = [asyncio.create_task(rt.submit(Op.FORWARD, sample(v))) for v in values]
    await wait_until_async(lambda: rt.queued_samples == 20, what="twenty queued samples")
    backend.gate.set()
    results = await asyncio.gather(first, *rest)
    assert [float(r["boundary"][0, 0, 0]) for r in results] == [2.0 * v for v in [1, *values]]
    # 20 waiting: the maximum (8, not half of 20), then half of what waits each time -- 6 of
    # 12, 3 of 6 -- down to a pair (min_batch_samples), then the last one alone
    assert [size for _op, size in backend.batches] == [1, 8, 6, 3, 2, 1]
    assert wakes.count("agora-compute") == 6  # the answers of a batch wake the loop once


async def test_a_microbatch_takes_every_waiting_sample_up_to_min_batch_samples():
    backend = GatedBackend()
    rt = Runtime(backend, max_batch_samples=8, max_batch_tokens=1000, min_batch_samples=4)
    rt.start()
    try:
        first = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
        await wait_until_async(backend.started.is_set, what="the first batch to start")
        rest = [asyncio.create_task(rt.submit(Op.FORWARD, sample(v))) for v in range(2, 8)]
        await wait_until_async(lambda: rt.queued_samples == 6, what="six queued samples")
        backend.gate.set()
        await asyncio.gather(first, *rest)
    finally:
        backend.gate.set()
        rt.stop()
    assert [size for _op, size in backend.batches] == [1, 4, 2]  # 4 of 6 (more than half), then 2


async def test_the_queue_with_the_older_request_is_served_first(runtime):
    rt, backend = runtime
    blocker = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(backend.started.is_set, what="the first batch to start")
    older = asyncio.create_task(
        rt.submit(Op.BACKWARD, {**sample(2), "grad": np.ones((1, 4, 2), dtype=np.float32)})
    )
    await wait_until_async(lambda: rt.queued_samples == 1, what="the backward to queue")
    newer = [asyncio.create_task(rt.submit(Op.FORWARD, sample(3))) for _ in range(3)]
    await wait_until_async(lambda: rt.queued_samples == 4, what="the forwards to queue")
    backend.gate.set()
    await asyncio.gather(blocker, older, *newer)
    # the older backward before the newer forwards (those in a pair, then one)
    assert [op for op, _size in backend.batches] == ["forward", "backward", "forward", "forward"]


async def test_only_requests_of_one_op_and_length_share_a_batch(runtime):
    rt, backend = runtime
    blocker = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(backend.started.is_set, what="the first batch to start")
    tasks = [asyncio.create_task(rt.submit(Op.FORWARD, sample(2, t=4 if i % 2 else 6))) for i in range(6)]
    await wait_until_async(lambda: rt.queued_samples == 6, what="six queued")
    backend.gate.set()
    await asyncio.gather(blocker, *tasks)
    # three of each length wait: a pair of each, then the third of each alone -- never mixed
    assert [size for _op, size in backend.batches[1:]] == [2, 2, 1, 1]
    assert backend.lengths[1:] == [6, 4, 6, 4]


async def test_a_poisoned_request_fails_alone(runtime):
    rt, backend = runtime
    blocker = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(backend.started.is_set, what="the first batch to start")
    tasks = [asyncio.create_task(rt.submit(Op.FORWARD, sample(v))) for v in (10, 13, 11)]
    await wait_until_async(lambda: rt.queued_samples == 3, what="three queued")
    backend.gate.set()
    results = await asyncio.gather(blocker, *tasks, return_exceptions=True)
    assert isinstance(results[2], RuntimeError) and "poisoned" in str(results[2])
    assert float(results[1]["boundary"][0, 0, 0]) == 20.0 and float(results[3]["boundary"][0, 0, 0]) == 22.0
    # one bad request among good ones is no failing device: the run of failures restarts at 0
    assert (rt.failed_requests, rt.failures_in_a_row) == (1, 0)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="poisoned"):
            await rt.submit(Op.FORWARD, sample(13))
    assert (rt.failed_requests, rt.failures_in_a_row) == (3, 2)


async def test_abandoned_requests_are_not_computed(runtime):
    rt, backend = runtime
    blocker = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(backend.started.is_set, what="the first batch to start")
    doomed = asyncio.create_task(rt.submit(Op.FORWARD, sample(5)))
    kept = asyncio.create_task(rt.submit(Op.FORWARD, sample(6)))
    await wait_until_async(lambda: rt.queued_samples == 2, what="two queued")
    doomed.cancel()  # the caller's deadline passed
    await asyncio.gather(doomed, return_exceptions=True)
    backend.gate.set()
    await asyncio.gather(blocker, kept)
    assert [size for _op, size in backend.batches] == [1, 1]


async def test_control_work_runs_between_batches_on_the_compute_thread(runtime):
    rt, backend = runtime
    backend.gate.set()
    thread = await asyncio.wrap_future(rt.call(lambda: threading.current_thread().name))
    assert thread == "agora-compute"


async def test_a_control_whose_asker_gave_up_leaves_the_compute_thread_serving(runtime):
    rt, backend = runtime
    backend.gate.set()
    release = threading.Event()
    abandoned = rt.call(lambda: release.wait(timeout=30))
    assert abandoned.cancel()  # the asker stopped waiting (a stopping worker's step)
    release.set()
    async with asyncio.timeout(10):  # a dead compute thread would leave it waiting for ever
        result = await rt.submit(Op.FORWARD, sample(4))
    assert float(result["boundary"][0, 0, 0]) == 8.0
    assert rt._thread.is_alive()


async def test_a_forward_names_its_weights_and_only_backwards_of_the_same_weights_share_a_batch(runtime):
    rt, backend = runtime
    backend.gate.set()
    named = await rt.submit(Op.FORWARD, sample(1))
    assert named[VERSION] == 101  # what the backend named when the batch ran
    backend.gate.clear()  # the next batch waits, so the backwards queue behind it
    blocker = asyncio.create_task(rt.submit(Op.FORWARD, sample(1)))
    await wait_until_async(lambda: len(backend.batches) == 2, what="the blocking batch to start")
    grad = {"grad": np.ones((1, 4, 2), dtype=np.float32)}
    # 7 and 8 have kept weights of their own; 30, 31 and a backward naming none recompute under
    # the live ones, so they are one kind
    names = [8, 7, 30, 8, 7, 31, 8, 7, None]
    tasks = [
        asyncio.create_task(rt.submit(Op.BACKWARD, {**sample(2), **grad}, version=name)) for name in names
    ]
    await wait_until_async(lambda: rt.queued_samples == len(names), what="the backwards queued")
    backend.gate.set()
    await asyncio.gather(blocker, *tasks)
    # three of each kind wait: a pair of each, then the third of each alone -- never mixed,
    # each sample named to the backend by its own forward's version
    assert [size for _op, size in backend.batches[2:]] == [2, 2, 2, 1, 1, 1]
    assert backend.versions == [[8, 8], [7, 7], [30, 31], [8], [7], [None]]
