#!/usr/bin/env python3
"""Efficiency benchmark: the cost of decentralization, swarm vs centralized, same machine.

    python benchmarks/efficiency.py [--samples 1024] [--replicas 2 3] [--rounds 3] [--idle-seconds 20]
                                    [--no-spot-check-cost] [--json] [--smoke]

The tiny example model (examples/tiny.toml) trained over the same samples, in the same order:
  * centralized: ``tools/reference_train.py`` (every stage in one process, batches of
    ``target_batch_size``, torch on every core);
  * the main job: ``tools/swarm.py up`` (DHT seed, authorizer, health monitor, 4 stages x R
    workers, one trainer), as a user runs it, once per ``--replicas`` count.
Figures: swarm samples/s / centralized samples/s (target >= 0.63, the report's), the loss ratio over the last
quarter of the samples, 3 replicas vs 2 (target >= 0.9x: a replica adds capacity, not cost),
what an idle swarm burns: cores used by all its processes together with no trainer, and
(``--spot-check-cost``, on unless ``--smoke``) the largest swarm's samples/s with its trainer's
spot checks against the same swarm without them (target >= 0.97).
Each round runs the centralized baseline and then every swarm, in turn; a ratio is taken
within its round and the figure is the median over the rounds (values: the medians of the
rates), so a noisy minute on a shared machine moves one round, not the figure. ``--smoke``: one
round of 16 samples, one swarm of one worker per stage, a one-second idle window.

The bound on this machine: a worker keeps nothing between a sample's forward and its backward,
so its backward recomputes the forward. A sample costs a swarm 2 forwards + 1 backward (about
4 forward-units: a backward is ~2) where the centralized run pays 3, so at equal per-sample
cost the swarm's ceiling is 3/4 of the centralized rate, before messages, averaging, and 12
processes sharing two cores. So each swarm run also gives an account of its cores over its
training window (``benchmarks/_cpu_account.py``): milliseconds per sample by role (worker,
trainer, seed, authorizer, monitor) and thread kind (event loop, ZeroMQ I/O, other threads:
a worker's compute thread above all), and the cores' idle time, next to the centralized run's
cores x wall time per sample.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median

import _harness
from _churn_swarm import DrivenSwarm, ensure_shards, run_up  # benchmarks/ is on sys.path as a script
from _cpu_account import CpuAccount
from _report import Report
from agora_localswarm import proc
from agora_localswarm.results import centralized_rate

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "tiny.toml"
SWARM_RUN_S = 1800.0  # one `swarm.py up` of --samples samples, start to end
IDLE_REPLICAS = 2  # workers per stage of the idle swarm
IDLE_SETTLE_S = 5.0  # an idle swarm's start-up (joins, first announcements, weight sync) settling
SMOKE_SETTLE_S = 1.0


def mean_tail(losses: list[float]) -> float:
    """Mean loss over the last quarter of the samples (in the order they were trained)."""
    tail = losses[-max(1, len(losses) // 4) :]
    return sum(tail) / len(tail)


def centralized(shards: Path, samples: int, folder: Path, note) -> tuple[float, float]:
    """(samples/s, tail loss) of tools/reference_train.py, as the main job's last line runs it."""
    log = folder / "reference.losses.jsonl"
    note(f"centralized: {samples} samples")
    rate = centralized_rate(str(CONFIG), shards, samples, loss_log=log)
    if rate is None:
        raise RuntimeError(f"tools/reference_train.py could not train {CONFIG} on {shards}")
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    return rate, mean_tail(losses)


@dataclass
class SwarmRun:
    rate: float  # samples/s, first completion to last
    tail_loss: float
    cpu_ms_per_sample: dict[tuple[str, str], float]  # by (role, thread kind), over that window
    idle_ms_per_sample: float  # the cores' time no swarm process used, over that window


def swarm(
    shards: Path, samples: int, replicas: int, folder: Path, note, *, spot_checks: bool = True
) -> SwarmRun:
    """The main job with ``replicas`` workers per stage: its rate, tail loss and CPU account
    (``spot_checks`` False: its trainer checks no worker's output)."""
    run_dir = folder / f"swarm-r{replicas}{'' if spot_checks else '-unchecked'}"
    flags = ["--config", str(CONFIG), "--shards", str(shards), "--samples", str(samples)]
    flags += ["--replicas", str(replicas), "--no-export", "--status-interval", "30"]
    if not spot_checks:
        flags += ["--trainer-arg=--spot-check-fraction=0"]
    note(f"swarm: {replicas} workers per stage, {samples} samples{'' if spot_checks else ', no spot checks'}")
    with CpuAccount(run_dir) as account:
        done = run_up(flags, run_dir, timeout_s=SWARM_RUN_S, capture=True)
    found = re.search(r"training throughput: ([\d.]+) samples/s", done.stdout)
    if done.returncode != 0 or not found:
        logs = [Path(p) for p in re.findall(r"see (\S+\.log)", done.stdout + done.stderr)]
        tails = "".join(f"\n--- {p}:\n{p.read_text()[-2000:]}" for p in logs if p.exists())
        raise RuntimeError(f"swarm.py up failed ({done.returncode}):\n{done.stdout[-2000:]}{tails}")
    records = [json.loads(line) for line in (run_dir / "trainer-0.losses.jsonl").read_text().splitlines()]
    records.sort(key=lambda r: r["t"])
    start, end, counted = records[0]["t"], records[-1]["t"], max(1, len(records) - 1)
    used = account.between(start, end)
    idle_s = max(0.0, (os.cpu_count() or 1) * (end - start) - sum(used.values()))
    return SwarmRun(
        rate=float(found.group(1)),
        tail_loss=mean_tail([r["loss"] for r in records]),
        cpu_ms_per_sample={key: 1000 * seconds / counted for key, seconds in used.items()},
        idle_ms_per_sample=1000 * idle_s / counted,
    )


def report_cpu_account(report: Report, runs: list[SwarmRun], replicas: int, central_rate: float) -> None:
    """Where a swarm sample's time goes on this machine's cores (medians over the rounds), next
    to the centralized run's wall time per sample."""
    cores = os.cpu_count() or 1
    report.add("centralized_core_ms_per_sample", 1000 * cores / central_rate, f"ms ({cores} cores x wall)")
    keys = sorted({key for run in runs for key in run.cpu_ms_per_sample})
    for role, kind in keys:
        value = median([run.cpu_ms_per_sample.get((role, kind), 0.0) for run in runs])
        report.add(f"swarm_r{replicas}_cpu_{role}_{kind}_ms_per_sample", value, "ms")
    report.add(
        f"swarm_r{replicas}_idle_core_ms_per_sample", median([r.idle_ms_per_sample for r in runs]), "ms"
    )


def cpu_seconds(pid: int) -> float:
    """User + system CPU of one process so far (0 once it is gone)."""
    found = proc.stat(pid)
    return found.cpu_s if found is not None else 0.0


def idle_cores(
    shards: Path, replicas: int, seconds: float, folder: Path, note, settle_s: float = IDLE_SETTLE_S
) -> dict[str, float]:
    """Cores each role's processes use, summed, in a swarm serving with no trainer."""
    driven = DrivenSwarm(folder / f"idle-r{replicas}", str(CONFIG), shards, replicas, lanes=4)
    note(f"idle swarm: {replicas} workers per stage, {seconds:g} s without a trainer")
    try:
        driven.up()
        time.sleep(settle_s)  # past start-up: joins, first announcements, weight sync settle
        members = [m for m in driven.swarm.members if m.alive]
        before = {m.pid: cpu_seconds(m.pid) for m in members}
        started = time.monotonic()
        time.sleep(seconds)  # the measurement window itself, not a synchronization
        elapsed = time.monotonic() - started
        used: dict[str, float] = {}
        for m in members:
            used[m.role] = used.get(m.role, 0.0) + (cpu_seconds(m.pid) - before[m.pid]) / elapsed
        return used
    finally:
        driven.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024, help="samples per run (each run the same ones)")
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[2, 3], help="workers per stage, per swarm run"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of every run; figures are medians over them"
    )
    parser.add_argument(
        "--idle-seconds", type=float, default=20.0, help="idle window (0: skip the idle figure)"
    )
    parser.add_argument(
        "--spot-check-cost",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the largest swarm with no spot checks, for their cost",
    )
    _harness.add_arguments(parser, deadline_s=3600)
    args = _harness.parse(
        parser,
        smoke={"samples": 16, "replicas": [1], "rounds": 1, "idle_seconds": 1.0, "spot_check_cost": False},
    )
    report = Report("efficiency", as_json=args.json)
    shards = ROOT / ".agora" / "shards" / "bpe-512"  # the main job's own (tools/swarm.py default)
    report.note(f"the main job's shards, for {args.samples} samples")
    ensure_shards(shards, str(CONFIG), args.samples)
    with tempfile.TemporaryDirectory(prefix="agora-efficiency-") as tmp:
        folder = Path(tmp)
        central: list[tuple[float, float]] = []  # (samples/s, tail loss) per round
        swarms: dict[int, list[SwarmRun]] = {r: [] for r in args.replicas}
        checked = max(args.replicas)  # where votes settle mismatches (3 replicas or more)
        unchecked: list[SwarmRun] = []
        for index in range(args.rounds):
            report.note(f"round {index + 1} of {args.rounds}")
            here = folder / f"round-{index}"
            here.mkdir()
            central.append(centralized(shards, args.samples, here, report.note))
            for replicas in args.replicas:
                swarms[replicas].append(swarm(shards, args.samples, replicas, here, report.note))
            if args.spot_check_cost:
                unchecked.append(swarm(shards, args.samples, checked, here, report.note, spot_checks=False))
            rates = ", ".join(f"r{r} {swarms[r][-1].rate:.1f}" for r in args.replicas)
            report.note(f"round {index + 1}: centralized {central[-1][0]:.1f}, {rates} samples/s")
        rate = median([c[0] for c in central])
        report.add("centralized_samples_per_s", rate, "samples/s")
        for replicas in args.replicas:
            runs = swarms[replicas]
            report.add(
                f"swarm_r{replicas}_vs_centralized_samples_per_s",
                median([r.rate for r in runs]),
                "samples/s",
                baseline=rate,
                ratio=median([r.rate / c[0] for r, c in zip(runs, central, strict=True)]),
                target="ratio >= 0.63 (the report's)" if replicas == 2 else None,
            )
            report.add(
                f"swarm_r{replicas}_vs_centralized_tail_loss",
                median([r.tail_loss for r in runs]),
                "nats/token",
                baseline=median([c[1] for c in central]),
                ratio=median([r.tail_loss / c[1] for r, c in zip(runs, central, strict=True)]),
            )
        if 2 in swarms and 3 in swarms:
            report.add(
                "swarm_r3_vs_r2_samples_per_s",
                median([r.rate for r in swarms[3]]),
                "samples/s",
                baseline=median([r.rate for r in swarms[2]]),
                ratio=median([r3.rate / r2.rate for r3, r2 in zip(swarms[3], swarms[2], strict=True)]),
                target="ratio >= 0.9",
            )
        if unchecked:
            report.add(
                f"swarm_r{checked}_spot_checked_vs_unchecked_samples_per_s",
                median([r.rate for r in swarms[checked]]),
                "samples/s",
                baseline=median([r.rate for r in unchecked]),
                ratio=median([c.rate / u.rate for c, u in zip(swarms[checked], unchecked, strict=True)]),
                target="ratio >= 0.97 (spot checks cost at most 3 %)",
            )
        for replicas in args.replicas:
            report_cpu_account(report, swarms[replicas], replicas, rate)
        if args.idle_seconds > 0:
            # --smoke: the smallest swarm, briefly settled; it measures nothing
            replicas, settle_s = (1, SMOKE_SETTLE_S) if args.smoke else (IDLE_REPLICAS, IDLE_SETTLE_S)
            used = idle_cores(shards, replicas, args.idle_seconds, folder, report.note, settle_s)
            for role, cores in sorted(used.items()):
                report.add(f"idle_{role}_cores", cores, "cores")
            report.add("idle_swarm_cores", sum(used.values()), "cores", target="nearly 0")
    report.finish()


if __name__ == "__main__":
    main()
