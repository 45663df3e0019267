"""The worker's compute loop in a simulation: the same coalescing, its compute time in virtual time."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from agora_core import world
from agora_sim import Simulation
from agora_worker.serving.runtime import Op, Runtime

PER_BATCH_S = 0.010
PER_SAMPLE_S = 0.001


class BilledBackend:
    """Holds its compute thread (world.hold) per batch and per sample, as a surrogate stage does."""

    def __init__(self):
        self.batches: list[int] = []
        self.started_at: list[float] = []

    def mark_version(self) -> int:
        return 1

    def forward(self, tokens, boundary):
        if bool((tokens == 13).any()):
            raise RuntimeError("poisoned sample")
        self.batches.append(tokens.shape[0])
        self.started_at.append(world.monotonic())
        world.hold(PER_BATCH_S + PER_SAMPLE_S * tokens.shape[0])
        return boundary * 2


def sample(value: int) -> dict[str, np.ndarray]:
    return {"tokens": np.full((1, 4), value), "boundary": np.full((1, 4, 2), float(value), dtype=np.float32)}


def simulated_runtime(sim: Simulation) -> tuple[Runtime, BilledBackend]:
    backend = BilledBackend()
    runtime = Runtime(backend, max_batch_samples=8, max_batch_tokens=1000)

    async def start():
        runtime.start()

    sim.run(start())
    return runtime, backend


def test_waiting_requests_coalesce_and_their_compute_takes_virtual_time():
    with Simulation(seed=1) as sim:
        runtime, backend = simulated_runtime(sim)
        started = world.monotonic()
        results = sim.run(asyncio.gather(*(runtime.submit(Op.FORWARD, sample(v)) for v in range(8))))
        elapsed_s = world.monotonic() - started
        assert [float(r["boundary"][0, 0, 0]) for r in results] == [2.0 * v for v in range(8)]
        assert backend.batches == [4, 2, 2]  # at most half of what waits, at least 2
        assert elapsed_s == pytest.approx(3 * PER_BATCH_S + 8 * PER_SAMPLE_S)
        assert runtime.samples_processed == 8
        runtime.stop()


def test_a_request_that_arrives_mid_batch_waits_for_it_in_virtual_time():
    with Simulation(seed=1) as sim:
        runtime, backend = simulated_runtime(sim)

        async def scenario():
            first = asyncio.ensure_future(runtime.submit(Op.FORWARD, sample(1)))
            await asyncio.sleep(0.004)  # the first batch (11 ms) is running
            started = world.monotonic()
            await runtime.submit(Op.FORWARD, sample(2))
            await first
            return world.monotonic() - started

        waited_s = sim.run(scenario())
        assert backend.batches == [1, 1]
        assert backend.started_at[1] - backend.started_at[0] == pytest.approx(PER_BATCH_S + PER_SAMPLE_S)
        assert waited_s == pytest.approx(2 * (PER_BATCH_S + PER_SAMPLE_S) - 0.004)
        runtime.stop()


def test_a_poisoned_request_fails_alone_in_a_simulation_too():
    with Simulation(seed=1) as sim:
        runtime, backend = simulated_runtime(sim)
        results = sim.run(
            asyncio.gather(
                *(runtime.submit(Op.FORWARD, sample(v)) for v in (5, 13, 7)), return_exceptions=True
            )
        )
        assert isinstance(results[1], RuntimeError)
        assert (
            float(results[0]["boundary"][0, 0, 0]) == 10.0 and float(results[2]["boundary"][0, 0, 0]) == 14.0
        )
        assert runtime.failed_requests == 1
        assert backend.batches == [1, 1]  # the failed pair, split: 5 alone, 13 failing alone; then 7
        runtime.stop()
