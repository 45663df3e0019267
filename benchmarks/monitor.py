#!/usr/bin/env python3
"""Monitor benchmark: snapshot ingest of a large simulated run, and the dashboard API's latency.

    python benchmarks/monitor.py [--workers 1000] [--trainers 100] [--stages 10] [--snapshots 5]
                                 [--backends sqlite,postgresql] [--hours 24] [--requests 200]
                                 [--json] [--smoke]

Ingest: ``--workers`` workers (spread over ``--stages``) and ``--trainers`` trainers, each its
own key, publish their signed announcement and progress (workers) or progress (trainers)
into a real DHT of 4 in-process members on 127.0.0.1, as a run's nodes do; before every
snapshot each worker's progress moves on. A snapshot is what the monitor does every period:
one ``get`` of every key of the run (in parallel), parse and check every record, fold it into the
ledger, commit its rows. Figures per backend: ``snapshot_s`` (median over ``--snapshots``;
target <= 1 s for 1000 workers on two cores) and its parts, ``read_s`` (the DHT) and
``write_s`` (the commit). The simulated nodes are not DHT members (1000 members in one
process are too heavy for this machine): the benchmark names them members of the snapshot,
which the monitor otherwise takes from the DHT's member list.

API: a database holding ``--hours`` of snapshots of such a run at the monitor's 5 s period
(the raw rows are synthesised directly in the database, not ingested: 24 h would take 24 h;
their per-minute rollup is then computed by the store's own ``rebuild_rollup``, the rows
``write`` would have kept),
served by the dashboard's app on 127.0.0.1; ``--requests`` rounds of the page's poll (runs,
overview, series, nodes, leaderboard, alerts), one request at a time. Figure: ``api_p99_ms``
over every request (target <= 200 ms), against ``runs_p50_ms``, the smallest endpoint's
median (the baseline: what a request costs at all). Benchmarks never fail on a time.

``--smoke``: 20 workers and 4 trainers over 2 stages, one snapshot, 3 minutes of history and
2 polls, on each backend (PostgreSQL only where installed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import load_run_config
from agora_core.contract import Phase
from agora_core.dht.records import owned_subkey
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.logs import configure_logging
from agora_core.observability.metrics import NodeMetrics
from agora_core.schema import (
    StageProgress,
    TrainerProgress,
    WorkerAnnouncement,
    stage_progress_key,
    stage_workers_key,
    trainer_progress_key,
)
from agora_monitor import schema
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.snapshot import MemberInfo, members_of, parse_snapshot, read_keys, run_keys
from agora_monitor.store import MonitorStore
from agora_monitor.web import make_app, start_site

ROOT = Path(__file__).resolve().parent.parent
PERIOD_S = 5.0
TTL_S = 3600.0
REQUEST_TIMEOUT_S = 60.0  # one dashboard request; aiohttp's default would wait 5 minutes


def big_run(stages: int):
    run = load_run_config(ROOT / "examples" / "tiny.toml")
    model = dataclasses.replace(run.model, stage_layers=tuple([1] * stages))
    dht = dataclasses.replace(run.dht, max_expiration_ahead_s=2 * TTL_S, op_timeout_s=30.0)
    return dataclasses.replace(run, name="bench", model=model, dht=dht)


class SimulatedRun:
    """Workers and trainers (keys only) writing their records through the DHT's members."""

    def __init__(self, run, dht_nodes: list[RunNode], workers: int, trainers: int):
        self.run, self.nodes = run, dht_nodes
        stages = run.model.n_stages
        self.workers = [(NodeKey.generate(), i % stages) for i in range(workers)]
        self.trainers = [NodeKey.generate() for _ in range(trainers)]
        self.round = 0

    def members(self) -> dict[str, MemberInfo]:
        out = {
            k.node_id: MemberInfo(k.node_id, "", "worker", f"acct-{i % 50}", s)
            for i, (k, s) in enumerate(self.workers)
        }
        out |= {
            k.node_id: MemberInfo(k.node_id, "", "trainer", f"acct-{i % 50}", None)
            for i, k in enumerate(self.trainers)
        }
        return out

    async def _store(self, index: int, key: str, signer: NodeKey, value: dict) -> None:
        dht = self.nodes[index % len(self.nodes)].dht
        await dht.store(key, owned_subkey(signer.public_key), value, time.time() + TTL_S, signer=signer)

    async def publish(self, *, announce: bool) -> None:
        """Every worker's progress (and announcement, the first time) and every trainer's."""
        self.round += 1
        name, r, writes = self.run.name, self.round, []
        for i, (key, stage) in enumerate(self.workers):
            if announce:
                value = WorkerAnnouncement(node_id=key.node_id, address=f"tcp://127.0.0.1:{20000 + i}", stage=stage,
                                           phase=Phase.SERVING, throughput=20.0, load=0, max_batch=8, version="0.1.0")  # fmt: skip
                writes.append(self._store(i, stage_workers_key(name, stage), key, value.to_value()))
            progress = StageProgress(node_id=key.node_id, step=r, samples=i % 5)
            writes.append(self._store(i, stage_progress_key(name, stage), key, progress.to_value()))
        for i, key in enumerate(self.trainers):
            report = TrainerProgress(
                node_id=key.node_id, loss_ema=3.0, loss_last=3.0, samples=50 * r, tokens=6400 * r, lanes=4
            )
            writes.append(self._store(i, trainer_progress_key(name), key, report.to_value()))
        for start in range(0, len(writes), 200):  # bounded fan-out: a few hundred requests at once
            await asyncio.gather(*writes[start : start + 200])


async def ingest_figures(report: Report, args, backends: list[str], postgres_url) -> None:
    run = big_run(args.stages)
    nodes: list[RunNode] = []
    try:
        report.note("starting 4 DHT members")
        for _ in range(4):
            bootstrap = [nodes[0].dht.address] if nodes else []
            node = RunNode(
                run=run, key=NodeKey.generate(), metrics=NodeMetrics(role="bench"), bootstrap=bootstrap
            )
            await node.start()
            nodes.append(node)
        # every member knows every other before anything is written: a writer that still
        # knows only part of the swarm stores at other replicas than a reader then asks
        ids = {n.dht.node_id for n in nodes}
        deadline = time.monotonic() + 30
        while any({m.node_id for m in n.dht.members()} != ids for n in nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("the 4 DHT members did not learn of each other within 30 s")
            await asyncio.sleep(0.05)
        sim = SimulatedRun(run, nodes, args.workers, args.trainers)
        report.note(
            f"publishing {args.workers} workers' and {args.trainers} trainers' records into 4 DHT members"
        )
        await sim.publish(announce=True)
        monitor = nodes[-1]
        for backend in backends:
            with tempfile.TemporaryDirectory() as tmp:
                url = f"sqlite:///{tmp}/monitor.db" if backend == "sqlite" else postgres_url()
                store = MonitorStore(url)
                store.ensure_run(run, time.time())
                ingest = Ingest(run, MonitorSettings(), *store.restore(run.name))
                totals, reads, writes = [], [], []
                report.note(f"{backend}: {args.snapshots} snapshots of the run")
                for _ in range(args.snapshots):
                    await sim.publish(announce=False)
                    started = time.perf_counter()
                    found = await read_keys(monitor.dht, list(run_keys(run).values()))
                    read = time.perf_counter()
                    snap = parse_snapshot(run, time.time(), found, members_of(monitor.dht) | sim.members())
                    rows = ingest.apply(snap)
                    written = time.perf_counter()
                    store.write(rows)
                    done = time.perf_counter()
                    totals.append(done - started)
                    reads.append(read - started)
                    writes.append(done - written)
                    assert len(snap.workers) == args.workers, len(snap.workers)
                store.close()
            n = f"{args.workers} workers"
            report.add(f"{backend}.snapshot_s ({n})", statistics.median(totals), "s", target="<= 1")
            report.add(f"{backend}.read_s", statistics.median(reads), "s")
            report.add(f"{backend}.write_s", statistics.median(writes), "s")
    finally:
        for node in reversed(nodes):
            await node.stop()


def synthesise_day(store: MonitorStore, run, hours: float, workers: int, trainers: int) -> int:
    """``hours`` of 5 s snapshots of a run with ``workers`` workers, written as rows."""
    now, stages = time.time(), run.model.n_stages
    count = int(hours * 3600 / PERIOD_S)
    t0 = now - count * PERIOD_S
    store.ensure_run(run, t0)
    with store.transaction(write=True) as c:
        c.execute(schema.runs.update().values(last_t=now - PERIOD_S))
        for start in range(0, count, 2000):
            batch = range(start, min(count, start + 2000))
            c.execute(schema.snapshots.insert(), [
                {"id": i + 1, "run": run.name, "t": t0 + i * PERIOD_S, "workers": workers, "trainers": trainers,
                 "samples": 50 * i, "tokens": 6400 * i, "tokens_per_s": 1280.0, "loss": 5.0 - i / count,
                 "nonfinite_losses": 0, "ingest_s": 0.3} for i in batch])  # fmt: skip
            c.execute(schema.stage_snapshots.insert(), [
                {"snapshot_id": i + 1, "run": run.name, "t": t0 + i * PERIOD_S, "stage": s, "workers_serving": workers // stages,
                 "workers_syncing": 0, "step": i, "samples": 50 * i, "averaging_success": 0.95, "reduce_success": 1.0}
                for i in batch for s in range(stages)])  # fmt: skip
        c.execute(schema.stages.insert(), [
            {"run": run.name, "stage": s, "step": count, "step_changed_t": now - 10, "completed_samples": 50 * count,
             "samples": 50 * count, "workers_serving": workers // stages, "samples_gap": 0, "reconciled": True,
             "last_t": now} for s in range(stages)])  # fmt: skip
        c.execute(schema.nodes.insert(), [
            {"run": run.name, "node_id": f"{i:040x}", "role": "worker" if i < workers else "trainer",
             "account": f"acct-{i % 50}", "stage": i % stages if i < workers else None, "phase": "serving",
             "address": f"tcp://10.0.0.{i % 250}:{20000 + i}", "version": "0.1.0", "throughput": 20.0, "load": 0,
             "step": count, "step_samples": 3, "samples": 1000 + i, "tokens": 0, "reported_samples": None,
             "reported_tokens": None, "restarts": 0, "loss": None, "live": True, "first_seen": t0, "last_seen": now,
             "lost_t": None, "termination_reason": None, "termination_detail": None, "terminated_t": None}
            for i in range(workers + trainers)])  # fmt: skip
    store.rebuild_rollup(run.name)
    return count


async def api_figures(report: Report, args, backends: list[str], postgres_url) -> None:
    run = big_run(args.stages)
    polls = ["/api/runs", "overview", "series?points=300", "nodes", "leaderboard", "alerts"]
    for backend in backends:
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/monitor.db" if backend == "sqlite" else postgres_url()
            store = MonitorStore(url)
            report.note(f"{backend}: synthesising {args.hours:g} h of snapshots")
            started = time.perf_counter()
            count = synthesise_day(store, run, args.hours, args.workers, args.trainers)
            report.note(
                f"{backend}: {count} snapshots ({args.hours:g} h) synthesised in {time.perf_counter() - started:.0f} s"
            )
            runner, base = await start_site(make_app(store, MonitorSettings()), "127.0.0.1", 0)
            latencies: dict[str, list[float]] = {p: [] for p in polls}
            report.note(f"{backend}: {args.requests} rounds of the dashboard's poll")
            timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session:
                    for _ in range(args.requests):
                        for poll in polls:
                            path = poll if poll.startswith("/") else f"/api/runs/{run.name}/{poll}"
                            t = time.perf_counter()
                            async with session.get(base.rstrip("/") + path) as response:
                                await response.read()
                                assert response.status == 200, path
                            latencies[poll].append(time.perf_counter() - t)
            finally:
                await runner.cleanup()
                store.close()
        every = sorted(x for values in latencies.values() for x in values)
        p99 = every[int(0.99 * (len(every) - 1))] * 1e3
        base_ms = statistics.median(latencies["/api/runs"]) * 1e3
        report.compare(f"{backend}.api_p99_ms ({args.hours:g} h)", p99, base_ms, "ms", target="<= 200")
        for poll, values in latencies.items():
            values.sort()
            report.add(
                f"{backend}.p99_ms {poll.split('?')[0]}", values[int(0.99 * (len(values) - 1))] * 1e3, "ms"
            )


def without_absent_postgres(backends: list[str], postgres_url, report: Report) -> list[str]:
    """``backends`` less PostgreSQL where its server cannot run here (--smoke: the SQLite
    path is still proved); else the server is started now."""
    from agora_devkit.postgres import PostgresUnavailable

    try:
        postgres_url()
    except PostgresUnavailable as error:
        report.note(f"--smoke: PostgreSQL left out, it cannot run here: {error}")
        return [b for b in backends if b != "postgresql"]
    return backends


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=1000, help="Simulated workers.")
    parser.add_argument("--trainers", type=int, default=100, help="Simulated trainers.")
    parser.add_argument("--stages", type=int, default=10, help="Stages the workers are spread over.")
    parser.add_argument("--snapshots", type=int, default=5, help="Snapshots timed per backend.")
    parser.add_argument(
        "--backends", default="sqlite,postgresql", help="Comma-separated: sqlite, postgresql."
    )
    parser.add_argument("--hours", type=float, default=24.0, help="History in the API's database.")
    parser.add_argument("--requests", type=int, default=100, help="Rounds of the dashboard's poll.")
    _harness.add_arguments(parser, deadline_s=1800)
    args = _harness.parse(
        parser,
        smoke={"workers": 20, "trainers": 4, "stages": 2, "snapshots": 1, "hours": 0.05, "requests": 2},
    )
    configure_logging(fmt="console", level="error")
    report = Report("monitor", as_json=args.json)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    with contextlib.ExitStack() as stack:
        server = []

        def postgres_url() -> str:  # one throwaway server for every PostgreSQL figure
            from agora_devkit.postgres import create_database, postgres_server

            if not server:
                report.note("starting a throwaway PostgreSQL server")
                server.append(stack.enter_context(postgres_server()))
            return create_database(server[0])

        if args.smoke and "postgresql" in backends:
            backends = without_absent_postgres(backends, postgres_url, report)
        asyncio.run(ingest_figures(report, args, backends, postgres_url))
        asyncio.run(api_figures(report, args, backends, postgres_url))
    report.finish()


if __name__ == "__main__":
    sys.exit(main())
