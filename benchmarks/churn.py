#!/usr/bin/env python3
"""Churn soak: the tiny swarm trains through an injected failure every 15 s, next to a calm run.

    python benchmarks/churn.py [--json] [--duration 600] [--interval 15] [--seed 0]
                               [--config examples/tiny.toml] [--shards DIR] [--replicas 2] [--lanes 4]
                               [--smoke]

First the churn run: the tiny swarm of tools/swarm.py (authorized: an authorizer admits and
places every node; monitored: the health monitor runs), ``--replicas`` workers per stage and
one trainer, for ``--duration`` seconds. Every ``--interval`` seconds the operator (this
process, a DHT member with the swarm's operator credential) writes one injection record,
drawn at random: a trigger (now, after, averaging_send, forward, backward, download) and a
role (workers three times as often as the trainer), then an action (exit, hang, drop_link,
slow; ``nan`` is left out: it costs a sample by design). A ``download`` failure starts a
joiner that is told to exit mid state download. A fatal action never targets the last
serving replica of a stage (its announcement read from the DHT): a stage left with replicas
in weight sync only never steps again, so they never finish syncing (a stage-loss test, not
a churn test). Dead workers are replaced after a random delay (2-10 s; the replacement
downloads the stage's state), a crashed trainer is restarted on its own state file.

Then the calm run: a fresh swarm of the same size trains on the same shards for exactly as
many samples as the churn run completed. Figures (JSON with --json): samples lost and
completed twice (targets 0, from the trainer's loss log: every completed sample id, and the
sample ids it abandoned), loss over the last samples against the calm run's at the same
sample count (target within 5%), tokens/s against the calm run (target >= 0.7x), averaging
rounds completed against attempted (every worker's round reports, both runs), and the
failures injected, obeyed (``injection_obeyed`` lines) and survived (training went on).
``--duration 180`` makes a short soak of it; ``--smoke`` runs both swarms with one worker per
stage, a failure every 2 s for 8 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import _harness
from _churn_logs import abandoned_ids, last_loss, log_lines, read_losses, rounds, sample_figures, sample_order
from _churn_swarm import ROOT, DrivenSwarm, load_run_config
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.contract import Phase
from agora_core.dht import DhtError
from agora_core.errors import RpcError
from agora_core.injection import Targets
from agora_core.injection.publish import new_injection, publish
from agora_core.node.run_node import RunNode
from agora_core.observability.logs import configure_logging
from agora_core.observability.metrics import NodeMetrics
from agora_core.schema import WorkerAnnouncement, parse_entries, stage_workers_key
from agora_localswarm.cli import default_shards_dir

TRIGGERS = ("now", "after", "averaging_send", "forward", "backward", "download")
FATAL = ("exit",)
JOIN_DHT_S = 60.0  # the operator's node joining the swarm's DHT
# After the churn: replacements (a start delay, then placement and serving, each with
# agora_localswarm.processes' start-up deadline) and a trainer's restart.
SETTLE_S = 300.0
CALM_START_S = 300.0  # the calm trainer's start, before its first sample
CALM_SAMPLES_PER_S = 1.0  # far below any machine's rate: only a calm run that hangs is slower


@dataclass
class Failure:
    at_s: float
    role: str
    trigger: str
    action: str
    record: str
    target: str


@dataclass
class Churn:
    swarm: DrivenSwarm
    rng: random.Random
    interval_s: float
    node: RunNode | None = None
    failures: list[Failure] = field(default_factory=list)
    doomed: dict[str, float] = field(default_factory=dict)  # node id -> until when (a fatal record)
    replacing: dict[int, int] = field(default_factory=dict)  # stage -> starts under way
    replaced: int = 0
    trainer_restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    starts: asyncio.Lock = field(default_factory=asyncio.Lock)  # one worker start at a time
    restarting_trainer: bool = False

    def injection(self, **fields):
        """A record issued now, carrying the operator's credential (an authorized run's nodes
        obey no operator key without it)."""
        return new_injection(credential=self.operator[1].to_value(), **fields)

    async def order(self, injection, failure: Failure) -> None:
        await publish(self.node.dht, self.operator[0], self.swarm.run.name, injection)
        self.failures.append(failure)
        print(
            f"# {failure.at_s:6.1f} s  {failure.record}: {injection.describe()}", file=sys.stderr, flush=True
        )

    async def start(self) -> None:
        key, credential = self.operator = self.swarm.operator()
        self.node = RunNode(
            run=self.swarm.run,
            key=key,
            metrics=NodeMetrics(role="operator"),
            bootstrap=[self.swarm.swarm.seed_address],
            credential=credential,
        )
        await asyncio.wait_for(self.node.start(), JOIN_DHT_S)

    # --- who may be hit -----------------------------------------------------------------------

    async def serving(self) -> set[str]:
        """Node ids whose announcement says serving (not downloading or syncing)."""
        run = self.swarm.run
        keys = [stage_workers_key(run.name, s) for s in range(run.model.n_stages)]
        try:
            found = await self.node.dht.get_many(keys)
        except (DhtError, RpcError):
            return set()  # nobody is known serving: no victim this time
        return {
            a.node_id
            for key in keys
            for a in parse_entries(found[key], WorkerAnnouncement.from_value)
            if a.phase is Phase.SERVING
        }

    async def victim_worker(self, fatal: bool):
        """A serving worker not already doomed; for a fatal action, one of a stage that keeps
        another one. A replica in weight sync does not count: a stage left with only syncing
        replicas never steps again (nothing routes to them), so they never finish syncing;
        losing a stage's last serving replica is a stage-loss test, not a churn test.
        (Reading the swarm waits on its lock: off the event loop.)"""
        workers = await asyncio.to_thread(self.swarm.members, "worker")
        serving = await self.serving()
        now = time.monotonic()
        healthy = [m for m in workers if m.node_id in serving and self.doomed.get(m.node_id, 0) < now]
        per_stage = {s: sum(m.stage == s for m in healthy) for s in range(self.swarm.run.model.n_stages)}
        pool = [m for m in healthy if not fatal or per_stage[m.stage] >= 2]
        return self.rng.choice(pool) if pool else None

    # --- one failure ----------------------------------------------------------------------------

    def params(self, action: str) -> dict:
        if action == "hang":
            return {"duration_s": round(self.rng.uniform(3, 8), 1)}
        if action == "drop_link":
            return {"duration_s": round(self.rng.uniform(3, 10), 1)}
        if action == "slow":
            return {"factor": 3.0, "duration_s": round(self.rng.uniform(10, 20), 1)}
        return {}

    async def inject_one(self) -> None:
        trigger = self.rng.choice(TRIGGERS)
        at_s = time.monotonic() - self.started
        if trigger == "download":
            await self.joiner_dies_mid_download(at_s)
            return
        role = "worker" if trigger == "averaging_send" else self.rng.choices(["worker", "trainer"], [3, 1])[0]
        weights = [5, 1, 2, 2] if role == "worker" else [2, 1, 2, 2]
        action = self.rng.choices(["exit", "hang", "drop_link", "slow"], weights)[0]
        params = self.params(action)
        if trigger == "after":
            params["after_s"] = round(self.rng.uniform(1, 8), 1)
        if role == "trainer":
            running = await asyncio.to_thread(self.swarm.trainer_running)
            if action in FATAL and (self.restarting_trainer or not running):
                action, params = "slow", self.params("slow")
            targets, target = Targets(role="trainer"), "trainer-0"
        else:
            victim = await self.victim_worker(action in FATAL)
            if victim is None:
                action, params = "slow", {**self.params("slow"), **params}
                victim = await self.victim_worker(False)
            if victim is None:
                return
            targets, target = Targets(nodes=(victim.node_id,)), victim.name
        injection = self.injection(trigger=trigger, action=action, targets=targets, ttl_s=45.0, **params)
        if action in FATAL and role == "worker":
            self.doomed[victim.node_id] = time.monotonic() + 60.0
        await self.order(injection, Failure(at_s, role, trigger, action, injection.id, target))

    async def joiner_dies_mid_download(self, at_s: float) -> None:
        stage = self.rng.randrange(self.swarm.run.model.n_stages)
        async with self.starts:
            key = self.swarm.next_worker_key()
            injection = self.injection(
                trigger="download",
                action="exit",
                targets=Targets(nodes=(key.node_id,), joiners=True),
                ttl_s=90.0,
            )
            await self.order(
                injection, Failure(at_s, "worker", "download", "exit", injection.id, key.node_id[:12])
            )
            member, proc = await asyncio.to_thread(self.swarm.start_worker, stage)
        await asyncio.to_thread(self._serving_or_dead, member, proc)

    def _serving_or_dead(self, member, proc) -> None:
        try:
            self.swarm.wait_serving(member, proc)
        except Exception as exc:  # died before it served: what a download failure does
            print(f"# {member.name} did not serve: {exc}", file=sys.stderr, flush=True)

    # --- keeping the swarm whole ------------------------------------------------------------------

    async def replace(self, stage: int) -> None:
        await asyncio.sleep(self.rng.uniform(2, 10))
        try:
            async with self.starts:
                member, proc = await asyncio.to_thread(self.swarm.start_worker, stage)
            await asyncio.to_thread(self._serving_or_dead, member, proc)
            self.replaced += 1
        finally:
            self.replacing[stage] -= 1

    async def restart_trainer(self) -> None:
        self.restarting_trainer = True
        await asyncio.sleep(self.rng.uniform(2, 10))
        await asyncio.to_thread(self.swarm.start_trainer, None)
        self.trainer_restarts += 1
        self.restarting_trainer = False

    async def keep(self, tasks: set) -> None:
        for dead in await asyncio.to_thread(self.swarm.reap):
            print(
                f"# {time.monotonic() - self.started:6.1f} s  {dead.name} is gone",
                file=sys.stderr,
                flush=True,
            )
            if dead.role == "trainer" and not self.restarting_trainer:
                tasks.add(asyncio.create_task(self.restart_trainer()))
        workers = await asyncio.to_thread(self.swarm.members, "worker")
        for stage in range(self.swarm.run.model.n_stages):
            alive = sum(1 for m in workers if m.stage == stage)
            missing = self.swarm.replicas - alive - self.replacing.get(stage, 0)
            for _ in range(max(0, missing)):
                self.replacing[stage] = self.replacing.get(stage, 0) + 1
                tasks.add(asyncio.create_task(self.replace(stage)))

    async def run(self, duration_s: float) -> None:
        tasks: set[asyncio.Task] = set()
        next_failure = self.started + self.interval_s
        while time.monotonic() - self.started < duration_s:
            await self.keep(tasks)
            if time.monotonic() >= next_failure:  # never a burst to catch up: one per interval
                next_failure = time.monotonic() + self.interval_s
                tasks.add(asyncio.create_task(self.inject_one()))
            tasks = {t for t in tasks if not t.done()}
            await asyncio.sleep(1.0)
        await self.settle(tasks)

    async def settle(self, tasks: set[asyncio.Task]) -> None:
        """Wait for the replacements and a trainer's restart under way to finish."""
        deadline = time.monotonic() + SETTLE_S
        while tasks or not await asyncio.to_thread(self.swarm.trainer_running):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the churn's replacements and the trainer's restart, within {SETTLE_S:g} s"
                )
            await self.keep(tasks)
            tasks = {t for t in tasks if not t.done()}
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self.node is not None:
            await self.node.stop()


async def churn_run(args, report: Report) -> tuple[DrivenSwarm, Churn, float]:
    swarm = DrivenSwarm(
        Path(args.run_dir) / "churn", args.config, Path(args.shards), args.replicas, args.lanes
    )
    report.note("churn run: starting the swarm ...")
    try:
        await asyncio.to_thread(swarm.up)
        await asyncio.to_thread(swarm.start_trainer, None)
        churn = Churn(swarm, random.Random(args.seed), args.interval)
        try:
            report.note("churn run: the operator joins the swarm's DHT ...")
            await churn.start()
            report.note(f"churn run: training, a failure every {args.interval:g} s for {args.duration:g} s")
            await churn.run(args.duration)
            ended = time.time()  # the churn run's throughput is counted up to here
        finally:
            await churn.stop()
    finally:
        await asyncio.to_thread(swarm.down)
    return swarm, churn, ended


async def calm_run(args, report: Report, samples: int) -> DrivenSwarm:
    swarm = DrivenSwarm(
        Path(args.run_dir) / "calm", args.config, Path(args.shards), args.replicas, args.lanes
    )
    report.note(f"calm run: the same swarm, {samples} samples, no failures ...")
    try:
        await asyncio.to_thread(swarm.up)
        trainer = await asyncio.to_thread(swarm.start_trainer, samples)
        timeout_s = CALM_START_S + samples / CALM_SAMPLES_PER_S
        try:
            await asyncio.to_thread(trainer.wait, timeout_s)  # it stops by itself after ``samples``
        except subprocess.TimeoutExpired:
            raise TimeoutError(
                f"the calm run's trainer to finish {samples} samples, within {timeout_s:g} s"
            ) from None
    finally:
        await asyncio.to_thread(swarm.down)
    return swarm


async def main_async(args) -> None:
    report = Report("churn", as_json=args.json)
    swarm, churn, ended = await churn_run(args, report)
    seq_len = swarm.run.model.seq_len
    order = sample_order(Path(args.shards), swarm.run)
    ours = sample_figures(read_losses(swarm.loss_log()), abandoned_ids(swarm), order, until=ended)
    # at least one sample: a trainer told 0 trains without end (a churn run too short: --smoke)
    calm = await calm_run(args, report, max(1, ours["completed"]))
    theirs = sample_figures(read_losses(calm.loss_log()), abandoned_ids(calm), order)
    count = min(ours["completed"], theirs["completed"])
    obeyed = {
        m.group(1)
        for line in log_lines(list((swarm.run_dir / "logs").glob("*.log")), "injection_obeyed")
        for m in [re.search(r"record=(\S+)", line)]
        if m
    }
    injected = [f.record for f in churn.failures]
    report.add(
        "samples_lost",
        ours["lost"] + ours["abandoned"],
        "samples (never completed, or abandoned)",
        target="== 0",
    )
    report.add("samples_completed_twice", ours["twice"], "samples", target="== 0")
    compare(
        report,
        "loss_at_equal_samples",
        last_loss(ours["losses"], count),
        last_loss(theirs["losses"], count),
        f"mean loss of the last {max(16, count // 10)} of {count} samples (vs the calm run)",
        target="0.95 .. 1.05",
    )
    compare(
        report,
        "tokens_per_s",
        ours["samples_per_s"] * seq_len,
        theirs["samples_per_s"] * seq_len,
        "tokens/s (vs the calm run)",
        target=">= 0.7",
    )
    attempted, completed = rounds(swarm.logs("worker"))
    calm_attempted, calm_completed = rounds(calm.logs("worker"))
    compare(
        report,
        "averaging_rounds_completed",
        completed / attempted if attempted else 0.0,
        calm_completed / calm_attempted if calm_attempted else 0.0,
        f"of {attempted} round reports attempted, completed in full ({completed}; calm run: "
        f"{calm_completed} of {calm_attempted}; vs the calm run's fraction)",
    )
    report.add("failures_injected", len(injected), f"records, one every {args.interval:g} s")
    report.add("failures_obeyed", sum(r in obeyed for r in injected), "records some node obeyed")
    fatal = [f for f in churn.failures if f.action in FATAL and f.record in obeyed]
    report.add("failures_survived", len(fatal), "obeyed exits, the run went on through each")
    report.add("workers_replaced", churn.replaced, "workers started to replace the dead")
    report.add("trainer_restarts", churn.trainer_restarts, "trainer restarts from its state file")
    report.add("samples_completed", ours["completed"], f"samples in {args.duration:g} s of churn")
    for failure in churn.failures:
        report.note(
            f"{failure.at_s:6.1f} s {failure.role:7} {failure.trigger:14} {failure.action:9} "
            f"{failure.target:14} {'obeyed' if failure.record in obeyed else 'not obeyed'}"
        )
    report.finish()


def compare(report: Report, name: str, value: float, baseline: float, unit: str, **kwargs) -> None:
    """``report.compare``; without a ratio where the calm run measured 0 (a run too short to
    measure anything: --smoke)."""
    if baseline:
        report.compare(name, value, baseline, unit, **kwargs)
    else:
        report.add(name, value, unit, baseline=baseline, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of churn (default 10 min)")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between failures")
    parser.add_argument("--seed", type=int, default=0, help="of the failure schedule")
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument(
        "--shards", help="made if missing (default: the main job's, for the config's tokenizer)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="workers per stage")
    parser.add_argument("--lanes", type=int, default=4, help="the trainer's samples in flight")
    parser.add_argument("--run-dir", default=str(ROOT / "runs" / "churn"), help="where both runs live")
    _harness.add_arguments(parser, deadline_s=4500)
    args = _harness.parse(parser, smoke={"duration": 8.0, "interval": 2.0, "replicas": 1, "lanes": 2})
    if args.shards is None:
        args.shards = str(default_shards_dir(load_run_config(args.config).data))
    configure_logging(fmt="console", level="warning")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
