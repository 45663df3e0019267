"""One simulation: its virtual loop and clock, its network, its seed, installed as the world."""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Awaitable
from typing import Any, TypeVar

from agora_core import world
from agora_core.identity import NodeKey
from agora_sim.hosts import current_host, track_tasks
from agora_sim.loop import VirtualClock, VirtualLoop
from agora_sim.network import SimNetwork
from agora_sim.trace import Trace

T = TypeVar("T")


class Simulation:
    """Use as a context manager: inside it, the world is this simulation's (one at a time)."""

    def __init__(self, seed: int):
        self.seed = seed
        self._seeds = random.Random(seed)
        self.clock = VirtualClock()
        self.loop = VirtualLoop(self.clock)
        track_tasks(self.loop)
        self.trace = Trace()
        self.network = SimNetwork(self.loop, random.Random(self._seeds.getrandbits(64)), self.trace)
        self._entered = False
        self._held_s = 0.0  # compute time billed by world.hold since the last take
        self._froze_heap = False

    def __enter__(self) -> Simulation:
        world.install(
            monotonic_fn=self.clock.monotonic,
            wall_fn=self._wall,
            rng_factory=self._rng,
            network_impl=self.network,
            hold_fn=self._hold,
            take_held_fn=self._take_held,
        )
        asyncio.set_event_loop(self.loop)
        self._entered = True
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._cancel_all()
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        finally:
            self.loop.close()
            asyncio.set_event_loop(None)
            world.restore()
            self._entered = False
            if self._froze_heap:
                gc.unfreeze()  # what the run left behind is the collector's again
                self._froze_heap = False

    def _wall(self) -> float:
        """The wall clock of the host the caller runs on: virtual, plus that host's skew."""
        host = current_host()
        return self.clock.wall() + host.skew_s if host is not None else self.clock.wall()

    def _hold(self, seconds: float) -> None:
        if seconds > 0:
            self._held_s += seconds

    def _take_held(self) -> float:
        held, self._held_s = self._held_s, 0.0
        return held

    def _cancel_all(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    # --- the seed ------------------------------------------------------------------------------

    def _rng(self, seed: Any = None) -> random.Random:
        return random.Random(self._seeds.getrandbits(64) if seed is None else seed)

    def rng(self) -> random.Random:
        """A generator for the scenario itself (fault times, choices), drawn from the seed."""
        return self._rng()

    def key(self) -> NodeKey:
        """A node key drawn from the seed (node ids decide DHT placement: they must replay)."""
        return NodeKey.from_seed(self._seeds.randbytes(32))

    # --- running -----------------------------------------------------------------------------

    @property
    def elapsed_s(self) -> float:
        """Virtual seconds since the simulation began."""
        return self.clock.elapsed_s

    def run(self, awaitable: Awaitable[T]) -> T:
        """Run until ``awaitable`` is done (everything else keeps running meanwhile)."""
        if not self._entered:
            raise RuntimeError("enter the Simulation (with Simulation(...) as sim) before running it")
        return self.loop.run_until_complete(awaitable)

    def run_for(self, seconds: float) -> None:
        """Let the world run ``seconds`` of virtual time."""
        self.run(asyncio.sleep(seconds))

    def freeze_heap(self) -> None:
        """Take what is alive now (the nodes brought up so far: their tables, connections,
        tasks) out of the garbage collector's scans until the simulation ends. A run of
        thousands of nodes holds gigabytes of long-lived objects that every full collection
        would walk again: at 250 DHT members that was 15 % of the run's real time. Call it
        after a start-up phase (it costs next to nothing: no collection runs); the event
        order, and so the digest, does not change."""
        gc.freeze()
        self._froze_heap = True

    def digest(self) -> str:
        return self.trace.digest()
