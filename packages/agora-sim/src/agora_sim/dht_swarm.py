"""A swarm of real :class:`~agora_core.dht.DhtNode` members on simulated hosts.

Each member gets a host of its own with a link drawn from the scenario's ranges and a key
drawn from the seed, joins through members already up, and can be killed (its process dies),
silenced (its link cut) or added later (a join). Operation latencies are measured in virtual
time, as a node would see them. ``authorized``: an authorized run, every member holding a
credential of a run authority drawn from the seed and speaking over CURVE (:mod:`sim.curve`),
each joiner told its bootstrap members' keys as a seed list names them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from agora_core import world
from agora_core.auth.security import TransportSecurity
from agora_core.config.run import DhtConfig
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_devkit.authority import TestAuthority
from agora_sim.hosts import SimHost
from agora_sim.links import LinkModel
from agora_sim.simulation import Simulation

MBIT = 1e6


@dataclass(kw_only=True, frozen=True)
class LinkRange:
    """Where the hosts' links are drawn from, uniformly (the report's consumer links by default:
    100-1000 Mbit/s, round trips of 10-150 ms between two of them)."""

    bandwidth_mbit: tuple[float, float] = (100.0, 1000.0)  # each of up and down
    one_way_ms: tuple[float, float] = (2.5, 37.5)  # a host's share: a path's round trip is 2 x (a + b)
    jitter_ms: float = 2.0
    loss: float = 0.0
    window_kb: float | None = None  # every host's TCP window (None: unlimited; see sim.links)

    def __post_init__(self) -> None:
        for name in ("bandwidth_mbit", "one_way_ms"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"LinkRange.{name} must be (low, high) with 0 <= low <= high")
        if self.window_kb is not None and not self.window_kb > 0:
            raise ValueError("LinkRange.window_kb must be positive (or absent: unlimited)")

    def draw(self, rng) -> LinkModel:
        up = rng.uniform(*self.bandwidth_mbit) * MBIT
        down = rng.uniform(*self.bandwidth_mbit) * MBIT
        return LinkModel(
            up_bits_per_s=up or None,
            down_bits_per_s=down or None,
            latency_s=rng.uniform(*self.one_way_ms) / 1000.0,
            jitter_s=self.jitter_ms / 1000.0,
            loss=self.loss,
            window_bytes=None if self.window_kb is None else max(1, round(self.window_kb * 1024)),
        )


class SimDhtSwarm:
    def __init__(
        self,
        sim: Simulation,
        *,
        links: LinkRange | None = None,
        config: DhtConfig | None = None,
        name: str = "dht",
        max_clock_skew_s: float = 0.0,
        authorized: bool = False,
    ):
        self.sim = sim
        # the run authority: its key and serials from the seed, so the credentials replay
        self.authority = TestAuthority(name, sim.key(), first_serial=1) if authorized else None
        self.links = links or LinkRange()
        self.config = config or DhtConfig()
        self.name = name
        self.max_clock_skew_s = max_clock_skew_s
        self._rng = sim.rng()
        self.nodes: list[DhtNode] = []
        self.hosts: dict[str, SimHost] = {}  # node id -> its host
        self.dead: set[str] = set()

    def live_nodes(self) -> list[DhtNode]:
        return [n for n in self.nodes if n.node_id not in self.dead]

    def host_of(self, node: DhtNode) -> SimHost:
        return self.hosts[node.node_id]

    def on(self, node: DhtNode, coro_fn: Callable):
        """Run ``coro_fn()`` as a task on ``node``'s host (what it calls goes out from there)."""
        with self.host_of(node).active():
            return self.sim.loop.create_task(coro_fn())

    def new_member(self) -> DhtNode:
        """A member on a new host, not started: it will join through up to three members
        already up."""
        live = [n for n in self.live_nodes() if n.address is not None]  # started
        index = len(self.nodes)
        host = self.sim.network.add_host(f"{self.name}-{index}", self.links.draw(self._rng))
        if self.max_clock_skew_s:
            host.skew_s = self._rng.uniform(-self.max_clock_skew_s, self.max_clock_skew_s)
        through = self._rng.sample(live, min(3, len(live)))
        key = self.sim.key()
        with host.active():
            node = DhtNode(
                key=key,
                config=self.config,
                bootstrap=[n.address for n in through],
                security=self._security(key, through),
            )
        self.nodes.append(node)
        self.hosts[node.node_id] = host
        return node

    def _security(self, key: NodeKey, bootstrap: list[DhtNode]) -> TransportSecurity | None:
        if self.authority is None:
            return None
        # a year: nobody renews credentials in a simulated run
        held = self.authority.credential(key, role="dht", stage=None, lifetime_s=365 * 86400.0)
        security = self.authority.security(key, held, max_clock_skew_s=self.config.max_clock_skew_s)
        for member in bootstrap:
            security.expect(member.address, member.key.public_key)
        return security

    async def join(self, node: DhtNode) -> None:
        with self.host_of(node).active():
            await node.start()

    def add(self, count: int = 1, *, batch: int = 50) -> list[DhtNode]:
        """Start ``count`` members, ``batch`` at a time (the first one alone)."""
        added: list[DhtNode] = []
        while len(added) < count:
            size = min(batch if self.live_nodes() else 1, count - len(added))
            group = [self.new_member() for _ in range(size)]
            self.sim.run(asyncio.gather(*(self.join(n) for n in group)))
            added.extend(group)
            self.sim.freeze_heap()  # the members stay: later collections need not walk them
        return added

    def kill(self, node: DhtNode) -> None:
        """The member's process dies: no goodbye, its connections drop."""
        self.dead.add(node.node_id)
        self.sim.network.kill(self.host_of(node))

    def converged(self) -> bool:
        """Every live member counts exactly the live members as live."""
        expected = {n.node_id for n in self.live_nodes()}
        return all(n.live_ids() == expected for n in self.live_nodes())

    def run_until(
        self, condition: Callable[[], bool], *, limit_s: float, step_s: float = 0.5
    ) -> float | None:
        """Virtual seconds until ``condition()`` holds (checked every ``step_s``), None if it
        does not within ``limit_s``."""
        started = self.sim.elapsed_s
        while not condition():
            if self.sim.elapsed_s - started >= limit_s:
                return None
            self.sim.run_for(step_s)
        return self.sim.elapsed_s - started

    def measure_ops(self, ops: int, *, ttl_s: float = 60.0) -> tuple[list[float], list[float]]:
        """``ops`` stores from random members, each read back by another: (store seconds,
        get seconds), in virtual time. A get that misses its value counts as a failure and
        raises: with every replica alive, a stored value must be readable."""
        stores: list[float] = []
        gets: list[float] = []
        for i in range(ops):
            writer, reader = self._rng.sample(self.live_nodes(), 2)
            key = f"{self.name}-op-{i}"

            async def store(writer=writer, key=key, i=i):
                started = world.monotonic()
                await writer.store(key, "v", i, world.wall() + ttl_s)
                return world.monotonic() - started

            async def get(reader=reader, key=key):
                started = world.monotonic()
                values = await reader.get(key)
                return world.monotonic() - started, values

            stores.append(self.sim.run(self.on(writer, store)))
            elapsed, values = self.sim.run(self.on(reader, get))
            if "v" not in values or values["v"].value != i:
                raise AssertionError(f"{key} was stored but its reader got {values!r}")
            gets.append(elapsed)
        return stores, gets

    def stop(self) -> None:
        for node in self.live_nodes():
            if node.address is not None:  # started
                with self.host_of(node).active():
                    self.sim.run(node.stop(leave=False))
