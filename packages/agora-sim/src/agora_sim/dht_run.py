"""Run a DHT scenario: the swarm comes up, then lives ``duration_s`` of virtual time through
churn while stores and read-backs are measured, then settles and is checked.

What an operator reads from it: how long the swarm took to agree on its membership, store and
get latency (p50/p99) as a member sees it, reads that missed a value stored before, the
member count over time, how long the views took to agree again after the churn stopped, and
how fast the simulation ran (virtual seconds per real second). Faults (partitions, silent
hosts, clock skew) come from the scenario's ``[faults]``; what must hold at the end is
:mod:`agora_sim.invariants`'s.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.dht import DhtNode
from agora_sim.dht_swarm import SimDhtSwarm
from agora_sim.scenario import Scenario
from agora_sim.simulation import Simulation

SETTLE_LIMIT_S = 120.0  # virtual seconds the views get to agree again after the churn


@dataclass
class Sample:
    time_s: float
    members: int
    ops: int
    get_p50_s: float | None


@dataclass
class DhtRunResult:
    scenario: Scenario
    digest: str = ""
    join_s: float | None = None
    settle_s: float | None = None
    stores_s: list[float] = field(default_factory=list)
    gets_s: list[float] = field(default_factory=list)
    failed_ops: int = 0
    missed_reads: int = 0
    joins: int = 0
    departures: int = 0
    partitions: int = 0
    silences: int = 0
    timeline: list[Sample] = field(default_factory=list)
    virtual_s: float = 0.0
    real_s: float = 0.0
    messages: int = 0
    violations: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        def quantile(values: list[float], q: float) -> float | None:
            return float(np.quantile(values, q)) if values else None

        return {
            "seed": self.scenario.seed,
            "members": self.scenario.members,
            "authorized": self.scenario.authorized,
            "digest": self.digest,
            "join_s": self.join_s,
            "settle_s": self.settle_s,
            "store_p50_s": quantile(self.stores_s, 0.5),
            "store_p99_s": quantile(self.stores_s, 0.99),
            "get_p50_s": quantile(self.gets_s, 0.5),
            "get_p99_s": quantile(self.gets_s, 0.99),
            "ops": len(self.gets_s),
            "failed_ops": self.failed_ops,
            "missed_reads": self.missed_reads,
            "joins": self.joins,
            "departures": self.departures,
            "partitions": self.partitions,
            "silences": self.silences,
            "messages": self.messages,
            "virtual_s": self.virtual_s,
            "real_s": self.real_s,
            "virtual_s_per_real_s": self.virtual_s / self.real_s if self.real_s else None,
            "violations": self.violations,
        }


class _Driver:
    def __init__(self, sim: Simulation, swarm: SimDhtSwarm, scenario: Scenario, result: DhtRunResult):
        self.sim, self.swarm, self.scenario, self.result = sim, swarm, scenario, result
        self.rng = sim.rng()
        self.tasks: set[asyncio.Task] = set()
        self._window: list[float] = []
        self._ops = 0
        self.stored: list[str] = []  # keys whose store was acknowledged
        self._healed = asyncio.Event()  # no partition in force
        self._healed.set()

    def _events(self, start: float, end: float) -> list[tuple[float, int, str]]:
        events: list[tuple[float, int, str]] = []
        rates = {
            "op": self.scenario.ops_per_s,
            "join": self.scenario.churn.joins_per_min / 60.0,
            "depart": self.scenario.churn.departures_per_min / 60.0,
            "partition": self.scenario.faults.partitions_per_min / 60.0,
            "silence": self.scenario.faults.silences_per_min / 60.0,
        }
        for kind, rate in rates.items():
            at = start
            while rate > 0:
                at += self.rng.expovariate(rate)
                if at >= end:
                    break
                events.append((at, len(events), kind))
        at = start
        while at + self.scenario.sample_s <= end:
            at += self.scenario.sample_s
            events.append((at, len(events), "sample"))
        heapq.heapify(events)
        return events

    async def run(self) -> None:
        start = self.sim.elapsed_s
        events = self._events(start, start + self.scenario.duration_s)
        while events:
            at, _, kind = heapq.heappop(events)
            await asyncio.sleep(max(0.0, at - self.sim.elapsed_s))
            getattr(self, f"_{kind}")()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._healed.wait()  # a partition's heal is due within partition_s

    def _spawn(self, node: DhtNode, coro_fn) -> None:
        task = self.swarm.on(node, coro_fn)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # seen: a killed host's

    def _op(self) -> None:
        live = self.swarm.live_nodes()
        if len(live) < 2:
            return
        writer, reader = self.rng.sample(live, 2)
        key = f"op-{self._ops}"
        self._ops += 1
        result = self.result

        async def store_then_read() -> None:
            try:
                started = world.monotonic()
                await writer.store(key, "v", 1, world.wall() + 300.0)
                result.stores_s.append(world.monotonic() - started)
                self.stored.append(key)
                started = world.monotonic()
                values = await self.swarm.on(reader, lambda: reader.get(key))
                elapsed = world.monotonic() - started
            except Exception:  # a member died under the op, or its replicas did: counted
                result.failed_ops += 1
                return
            result.gets_s.append(elapsed)
            self._window.append(elapsed)
            if "v" not in values:
                result.missed_reads += 1

        self._spawn(writer, store_then_read)

    def _join(self) -> None:
        node = self.swarm.new_member()
        self.result.joins += 1

        async def join() -> None:
            try:
                await self.swarm.join(node)
            except Exception:  # every member it knew died meanwhile: it gives up, as a node would
                self.swarm.kill(node)

        self._spawn(node, join)

    def _depart(self) -> None:
        live = self.swarm.live_nodes()
        if len(live) > 2:
            self.swarm.kill(self.rng.choice(live))
            self.result.departures += 1

    def _partition(self) -> None:
        hosts = [self.swarm.host_of(n) for n in self.swarm.live_nodes()]
        if not self._healed.is_set() or len(hosts) < 2:
            return
        self.rng.shuffle(hosts)
        cut = self.rng.randint(1, len(hosts) - 1)
        self.sim.network.partition([hosts[:cut], hosts[cut:]])
        self._healed.clear()
        self.result.partitions += 1
        self.sim.loop.call_later(self.scenario.faults.partition_s, self._heal)

    def _heal(self) -> None:
        self.sim.network.heal()
        self._healed.set()

    def _silence(self) -> None:
        live = self.swarm.live_nodes()
        if live:
            self.sim.network.silence(
                self.swarm.host_of(self.rng.choice(live)), self.scenario.faults.silence_s
            )
            self.result.silences += 1

    def _sample(self) -> None:
        window, self._window = self._window, []
        self.result.timeline.append(
            Sample(
                time_s=self.sim.elapsed_s,
                members=len(self.swarm.live_nodes()),
                ops=len(window),
                get_p50_s=float(np.median(window)) if window else None,
            )
        )


def run_dht_scenario(scenario: Scenario) -> DhtRunResult:
    result = DhtRunResult(scenario=scenario)
    real_started = time.perf_counter()
    with Simulation(seed=scenario.seed) as sim:
        swarm = SimDhtSwarm(
            sim,
            links=scenario.links,
            name="dht",
            max_clock_skew_s=scenario.faults.max_clock_skew_s,
            authorized=scenario.authorized,
        )
        swarm.add(scenario.members)
        result.join_s = swarm.run_until(swarm.converged, limit_s=SETTLE_LIMIT_S)
        if result.join_s is None:
            result.violations.append(
                f"the swarm's views did not agree within {SETTLE_LIMIT_S:g} s of starting"
            )
        sim.run(_Driver(sim, swarm, scenario, result).run())
        result.settle_s = swarm.run_until(swarm.converged, limit_s=SETTLE_LIMIT_S)
        if result.settle_s is None:
            result.violations.append(
                f"the views did not agree again within {SETTLE_LIMIT_S:g} s after the churn"
            )
        result.digest = sim.digest()
        result.messages = sim.trace.messages
        result.virtual_s = sim.elapsed_s
        swarm.stop()
    result.real_s = time.perf_counter() - real_started
    return result
