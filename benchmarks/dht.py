#!/usr/bin/env python3
"""DHT benchmark: one-hop operation latency, gossip convergence and steady-state traffic.

    python benchmarks/dht.py [--sizes 16 32 64 128] [--ops 300] [--latency-ms 0] [--json] [--smoke]

For each swarm size N (all nodes in this process, real sockets on 127.0.0.1):
  * get and store latency p50/p99 against one plain RPC round trip between two of the same
    nodes, measured in the same swarm at the same time, interleaved (target: get p99 <= 2x
    the round trip's p99, flat in N). Each p50 and p99 is the median over 5 rounds of --ops
    operations, taken round by round: one round's p99 is one stall or another, the median
    of rounds is what two runs agree on. Ratios compare like with like (p50/p50, p99/p99)
  * join: periods until a new node is in every member's view; crash: periods until no member
    still counts a killed node as alive (target: <= log2(N) + 3 periods), and until it has
    left every view (that adds the suspicion timeout). Two crashes: a node whose process
    dies (its connections drop, which triggers an immediate probe) and a node in its own
    process frozen with SIGSTOP (nothing drops: only the probe cycle finds it)
  * steady state: messages and bytes per node per second (flat or logarithmic in N)
  * authenticated (sizes up to --auth-max-size, 64 by default): the same latencies in a swarm
    of an authorized run (CURVE connections, credentialed members, signed claims and records)
    against the plain swarm's (target: get p99 <= 1.2x). Both swarms run side by side and
    take turns round by round, so the machine's load falls on both alike. Past 64 the in-process swarm is
    bound by this one process: 128 nodes may keep only 46 connections each open (file
    descriptors), so members outside a node's pool are re-dialled for every probe, and every
    authenticated dial costs a CURVE handshake and a credential greeting both ways; on two
    cores that swarm does not converge within the benchmark's wait. One node per process, as
    a run has them, keeps 256 connections.

``--smoke``: one swarm of 4 nodes at a fast gossip cadence, a few operations a round, plain
and authenticated.

With --latency-ms, every node sits behind an emulated link of that one-way latency, so
network time dominates CPU time as it does across the internet.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import random
import resource
import signal
import tempfile
import time

import numpy as np

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from _secured import security_of
from agora_core.config.run import DhtConfig
from agora_core.contract import Method
from agora_core.dht import DhtNode, Status
from agora_core.identity import NodeKey
from agora_core.node.heap import settle_startup_heap
from agora_core.observability.logs import configure_logging
from agora_core.rpc import RpcConfig
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator
from agora_devkit.processes import spawn_python

# The run config's defaults (1 s periods, 5 s suspicion timeout): a real swarm's cadence, and
# enough headroom for 128 nodes sharing one event loop on two cores.
CONFIG = DhtConfig()
# --smoke: a fast cadence, so the crash figures' waits take a second or two
SMOKE_CONFIG = dataclasses.replace(CONFIG, gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=1.0)
ROUNDS = 5  # latency figures: the median of this many rounds of --ops operations


def write_config(folder: str) -> str:
    """A run config file holding this benchmark's DHT settings, for member processes."""
    path = os.path.join(folder, "run.toml")
    with open(path, "w") as f:
        f.write("[dht]\n" + "".join(f"{k} = {v!r}\n" for k, v in dataclasses.asdict(CONFIG).items()))
    return path


async def wait_for(predicate, *, timeout_s: float, poll_s: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds (raises TimeoutError after ``timeout_s``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(poll_s)
    return time.monotonic() - start


class Swarm:
    def __init__(self, size: int, latency_ms: float, rng: random.Random, authorizer: NodeKey | None = None):
        """With ``authorizer``, an authorized run's swarm: CURVE connections with a greeting,
        members admitted by their credentials (signed by it), signed claims and records."""
        self.size = size
        self.rng = rng
        self.authorizer = authorizer
        # Every node may talk to every other; bound open connections so 2 ends x N x peers
        # stays inside the process's file descriptor limit.
        self.rpc = RpcConfig(max_connections=max(16, min(64, 12000 // (2 * size))))
        self.link = LinkConfig(latency_s=latency_ms / 1000) if latency_ms else None
        self.nodes: list[DhtNode] = []

    def make(self, bootstrap: list[DhtNode]) -> DhtNode:
        link = LinkEmulator(self.link) if self.link else None
        key, security = NodeKey.generate(), None
        if self.authorizer is not None:
            security = security_of(key, self.authorizer)
            for node in bootstrap:  # a bootstrap address names its node's key
                security.expect(node.address, node.key.public_key)
        return DhtNode(
            key=key,
            config=CONFIG,
            bootstrap=[node.address for node in bootstrap],
            rpc_config=self.rpc,
            link=link,
            seed=self.rng.randrange(1 << 30),
            security=security,
        )

    async def start(self) -> None:
        seed = self.make([])
        await seed.start()
        self.nodes.append(seed)
        for _ in range(self.size - 1):
            node = self.make([seed])
            await node.start()
            self.nodes.append(node)
        # As every node's command does once it serves (this process stands for N of them):
        # full collections then skip the startup heap instead of stalling the loop 100+ ms.
        settle_startup_heap()

    async def spawn_remote(self, bootstrap: str):
        """A member in its own OS process (``agora dht serve``): (child, node id, stack)."""
        stack = contextlib.ExitStack()
        folder = stack.enter_context(tempfile.TemporaryDirectory())
        command = ["-m", "agora_core", "dht", "serve", "--bootstrap", bootstrap]
        command += ["--config", write_config(folder), "--key-file", os.path.join(folder, "node.key")]
        command += ["--status-interval", "600"]
        child = stack.enter_context(spawn_python(command, env={"AGORA_LOG_LEVEL": "warning"}))
        node_id = await asyncio.to_thread(child.read_until, "agora dht node ")
        await asyncio.to_thread(child.read_until, "  serving    ")
        return child, node_id, stack

    def everyone_sees(self, node_id: str, statuses=(Status.ALIVE,)) -> bool:
        for node in self.nodes:
            member = node.table.get(node_id)
            if member is None or member.status not in statuses:
                return False
        return True

    def quiet(self) -> bool:
        """No member has news left to spread."""
        return all(n.table.pending_gossip == 0 for n in self.nodes)

    def converged(self) -> bool:
        ids = {n.node_id for n in self.nodes}
        return all({m.node_id for m in n.members()} == ids for n in self.nodes)

    async def stop(self) -> None:
        await asyncio.gather(*(n.stop(leave=False) for n in self.nodes), return_exceptions=True)


async def measure(report: Report, size: int, ops: int, latency_ms: float, authenticated: bool) -> None:
    rng = random.Random(size)
    swarm = Swarm(size, latency_ms, rng)
    period = CONFIG.gossip_period_s
    target = math.log2(size) + 3
    report.note(f"N={size}: starting")
    await swarm.start()
    try:
        await wait_for(swarm.converged, timeout_s=60 + size)
        await wait_for(swarm.quiet, timeout_s=120, poll_s=period)

        # join: a newcomer in every view
        newcomer = swarm.make([swarm.nodes[rng.randrange(size)]])
        started = time.monotonic()
        await newcomer.start()
        swarm.nodes.append(newcomer)
        await wait_for(lambda: swarm.everyone_sees(newcomer.node_id), timeout_s=60)
        join_periods = (time.monotonic() - started) / period
        report.add(f"N={size} join_known_by_all", join_periods, "periods", target=f"<= {target:.1f} periods")

        # steady state: once the join news has been gossiped out, traffic per node per second
        await wait_for(swarm.quiet, timeout_s=120, poll_s=period)
        before = [n.traffic() for n in swarm.nodes]
        t0 = time.monotonic()
        await asyncio.sleep(10 * period)
        elapsed = time.monotonic() - t0
        after = [n.traffic() for n in swarm.nodes]
        messages = np.mean([(a[0] - b[0]) / elapsed for a, b in zip(after, before, strict=True)])
        nbytes = np.mean([(a[1] - b[1]) / elapsed for a, b in zip(after, before, strict=True)])
        report.add(f"N={size} steady_messages_per_node", messages, "msg/s")
        report.add(f"N={size} steady_bytes_per_node", nbytes, "B/s")

        # latency: one RPC round trip vs store and get, interleaved, same swarm, same time; an
        # authorized run's swarm of the same size alongside, its rounds interleaved with these
        if authenticated:
            plain = await measure_authenticated(report, swarm, size, ops, latency_ms)
        else:
            plain = (await latencies([swarm], ops, rng))[0]
        rtt50, rtt99 = plain["rpc"]
        report.add(f"N={size} rpc_round_trip_p50", rtt50, "ms")
        report.add(f"N={size} rpc_round_trip_p99", rtt99, "ms")
        for name in ("get", "store"):
            p50, p99 = plain[name]
            report.compare(f"N={size} {name}_p50", p50, rtt50, "ms")
            report.compare(
                f"N={size} {name}_p99", p99, rtt99, "ms", target="ratio <= 2 vs one RPC round trip p99"
            )

        # crashes: a node whose process dies (its connections drop) and one that freezes
        # silently (a hung host: connections stay open, nothing answers)
        victim = swarm.nodes.pop(rng.randrange(1, len(swarm.nodes)))
        started = time.monotonic()
        await victim.stop(leave=False)
        await report_crash(report, swarm, victim.node_id, started, f"N={size} crash", target)

        frozen = await swarm.spawn_remote(swarm.nodes[rng.randrange(len(swarm.nodes))].address)
        try:
            await wait_for(lambda: swarm.everyone_sees(frozen[1]), timeout_s=60)
            started = time.monotonic()
            os.kill(frozen[0].pid, signal.SIGSTOP)
            await report_crash(report, swarm, frozen[1], started, f"N={size} silent_crash", target)
        finally:
            frozen[0].kill()
            frozen[2].close()
    finally:
        await swarm.stop()


async def latencies(
    swarms: list[Swarm], ops: int, rng: random.Random, rounds: int = ROUNDS
) -> list[dict[str, tuple[float, float]]]:
    """Per swarm, (p50, p99) in ms of one plain RPC round trip, a store and a get, interleaved,
    once every node has called every other: steady-state figures, not the cost of opening
    connections (a connection is opened once in a node's life; an authenticated one costs a
    few ms more). Each is the median over ``rounds`` rounds of ``ops`` operations: a p99 of a
    few hundred samples is one stall or another, and the median of rounds is what two runs
    agree on. Several swarms take turns round by round (the first going first every other
    round), so a burst of load on the machine falls on all of them alike."""
    for swarm in swarms:
        for a in swarm.nodes:  # as many as the in-process connection pool keeps open
            others = [b for b in swarm.nodes if b is not a][: swarm.rpc.max_connections]
            for start in range(0, len(others), 16):
                calls = (
                    a.client.call(b.address, Method.DHT_GET, {"keys": []}) for b in others[start : start + 16]
                )
                await asyncio.gather(*calls)
    expiration = time.time() + 600
    keys: list[list[str]] = [[] for _ in swarms]
    per_round: list[list[dict]] = [[] for _ in swarms]
    for r in range(rounds):
        order = list(range(len(swarms)))
        for i in order if r % 2 == 0 else order[::-1]:
            tag = f"{i}/{r}"
            per_round[i].append(await _one_round(swarms[i], ops, rng, expiration, keys[i], tag))
    return [
        {
            name: tuple(float(np.median([figures[name][q] for figures in rounds_of])) for q in (0, 1))
            for name in ("rpc", "store", "get")
        }
        for rounds_of in per_round
    ]


async def _one_round(
    swarm: Swarm, ops: int, rng: random.Random, expiration: float, keys: list[str], tag: str
) -> dict[str, tuple[float, float]]:
    rtts, stores, gets = [], [], []
    for i in range(ops):
        a, b = rng.sample(swarm.nodes, 2)
        t = time.perf_counter()
        await a.client.call(b.address, Method.DHT_GET, {"keys": []})  # a minimal handler
        rtts.append(time.perf_counter() - t)
        key = f"bench/{len(swarm.nodes)}/{tag}/{i}"
        t = time.perf_counter()
        await a.store(key, "v", i, expiration)
        stores.append(time.perf_counter() - t)
        keys.append(key)
        reader = rng.choice(swarm.nodes)
        t = time.perf_counter()
        value = await reader.get(rng.choice(keys))
        gets.append(time.perf_counter() - t)
        assert value, "a stored key read back empty"
    return {
        name: (np.percentile(samples, 50) * 1e3, np.percentile(samples, 99) * 1e3)
        for name, samples in (("rpc", rtts), ("store", stores), ("get", gets))
    }


async def measure_authenticated(
    report: Report, plain_swarm: Swarm, size: int, ops: int, latency_ms: float
) -> dict[str, tuple[float, float]]:
    """The latencies of ``plain_swarm`` and of an authorized run's swarm of the same size
    started next to it, their rounds interleaved; reports the authenticated against the plain
    and returns the plain ones."""
    rng = random.Random(size + 1)  # as many nodes as the plain swarm has (its newcomer too)
    swarm = Swarm(len(plain_swarm.nodes), latency_ms, rng, authorizer=NodeKey.generate())
    report.note(f"N={size}: starting the authenticated swarm alongside")
    await swarm.start()
    try:
        await wait_for(swarm.converged, timeout_s=60 + size)
        # its join news gossiped out too: both swarms share this process's one event loop,
        # so one still spreading news would load the other's figures as much as its own
        await wait_for(swarm.quiet, timeout_s=120, poll_s=CONFIG.gossip_period_s)
        plain, secured = await latencies([plain_swarm, swarm], ops, rng)
    finally:
        await swarm.stop()
    report.compare(f"N={size} auth_rpc_round_trip_p50", secured["rpc"][0], plain["rpc"][0], "ms")
    for name in ("get", "store"):
        report.compare(f"N={size} auth_{name}_p50", secured[name][0], plain[name][0], "ms")
        report.compare(
            f"N={size} auth_{name}_p99",
            secured[name][1],
            plain[name][1],
            "ms",
            target="ratio <= 1.2 vs the same without authentication",
        )
    return plain


async def report_crash(report: Report, swarm: Swarm, node_id: str, started: float, name: str, target: float):
    """Periods until no node counts ``node_id`` alive, then until it left every view."""
    period = CONFIG.gossip_period_s

    def nobody_counts_it_alive() -> bool:
        return all((m := n.table.get(node_id)) is None or m.status != Status.ALIVE for n in swarm.nodes)

    def gone_everywhere() -> bool:
        return all(node_id not in {m.node_id for m in n.members()} for n in swarm.nodes)

    await wait_for(nobody_counts_it_alive, timeout_s=60)
    report.add(
        f"{name}_known_by_all",
        (time.monotonic() - started) / period,
        "periods",
        target=f"<= {target:.1f} periods",
    )
    await wait_for(gone_everywhere, timeout_s=60)
    report.add(
        f"{name}_removed_everywhere",
        (time.monotonic() - started) / period,
        "periods",
        target=f"known + suspicion timeout ({CONFIG.suspicion_timeout_s / period:.0f} periods)",
    )


async def run(report: Report, sizes: list[int], ops: int, latency_ms: float, auth_max_size: int) -> None:
    for size in sizes:
        await measure(report, size, ops, latency_ms, size <= auth_max_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument(
        "--ops", type=int, default=300, help=f"stores and gets per round ({ROUNDS} rounds per size)"
    )
    parser.add_argument("--latency-ms", type=float, default=0.0, help="emulated one-way link latency")
    parser.add_argument(
        "--auth-max-size",
        type=int,
        default=64,
        help="largest N also measured authenticated (0: none); see the docstring",
    )
    _harness.add_arguments(parser, deadline_s=3600)
    args = _harness.parse(parser, smoke={"sizes": [4], "ops": 10, "auth_max_size": 4})
    if args.smoke:
        global CONFIG
        CONFIG = SMOKE_CONFIG
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # many sockets in one process
    configure_logging(fmt="console", level="warning")
    report = Report("dht", as_json=args.json)
    report.note(f"gossip period {CONFIG.gossip_period_s} s, link latency {args.latency_ms} ms one way")
    try:
        asyncio.run(run(report, args.sizes, args.ops, args.latency_ms, args.auth_max_size))
    finally:  # the sizes measured before a failure still count
        report.finish()


if __name__ == "__main__":
    main()
