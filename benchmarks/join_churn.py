#!/usr/bin/env python3
"""Joins under churn, judged by the model: a swarm loses a worker and gains one every ~12 s.

    python benchmarks/join_churn.py [--json] [--seeds 10] [--samples 6144] [--interval 12]
                                    [--settle-samples 512] [--replicas 3] [--smoke]

Each seed is one run of ``tools/swarm.py up`` (authorized, ``--replicas`` workers per stage,
the main job's trainer) over ``--samples`` samples, exported and scored on the held-out split
at its end. Once the trainer completed ``--settle-samples`` (512: the loss windows are judged
from there, and the learning-rate warm-up is behind it; a kill right at the warm-up's peak
can set a tiny run back for good, which ``--settle-samples 0`` shows), the driver SIGKILLs
the newest worker of a stage (``swarm.py kill-worker``) at once and then every ``--interval``
s (+-25 %, drawn from the seed), and half an interval after each adds one (``swarm.py add-worker``): the newcomer
downloads its stage's state from the live replicas, passes weight and optimizer sync, then
serves. The stage cycles
through every stage from a start drawn from the seed, so joins land on head, bodies and tail
alike. Then one calm run: the same swarm and samples, nothing killed.

Figures, per seed and the worst over seeds (``--json``: one object):
  * samples lost, and completed twice (the trainer's loss log against the shards' reading
    order; target 0);
  * the worst 64-sample window after the first 512 against the 64 samples before it (mean
    loss, in completion order; target <= 1.5);
  * the exported model's held-out loss against the calm run's (target <= 1.05);
  * the largest optimizer step any worker took, in samples, against the target batch size;
  * steps refused and resyncs (workers' logs), joins that reached serving, outliers the
    trainer's loss witness excluded.
Every wait has a deadline: a run that cannot finish is stopped, and the benchmark says what
it waited for and exits 1. ``--smoke``: one seed of 128 samples, two workers a stage, kills
from the 16th sample on, every 2 s, and a calm run of as many samples.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import _harness
from _churn_swarm import stop_up
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import load_run_config
from agora_localswarm.cli import default_shards_dir
from agora_trainer.data.cursor import reading_order
from agora_trainer.data.shards import open_shard_set

ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")

WINDOW = 64  # samples per loss window
SETTLE = 512  # samples before the windows are judged: the loss falls steeply at first
START_S = 240.0  # `up` until every worker serves (shards made, torch imported on two cores)
COMMAND_S = 150.0  # one kill-worker or add-worker
MARGIN_S = 120.0  # export, evaluation and the centralized comparison at the end of `up`
SMOKE_SAMPLES = 128  # the fewest that still leave room for a kill and an add before the end
# Every run's deadline together, with the default 10 seeds and 6144 samples (and a margin).
FULL_DEADLINE_S = 18000


class RunFailed(Exception):
    """A swarm run that did not finish in time or did not end cleanly."""


@dataclass
class Outcome:
    """What one run left behind, read from its output, logs and loss log."""

    held_out: float
    losses: list[tuple[int, float]]  # (sample id, loss) in completion order
    largest_step: int = 0
    refused: int = 0
    resyncs: int = 0
    joins_served: int = 0
    joined_stages: set[int] = field(default_factory=set)  # stages where a newcomer reached serving
    outliers: int = 0
    kills: list[int] = field(default_factory=list)  # the stages a worker was killed on


def swarm_command(run_dir: Path, *args: str) -> str:
    try:
        result = subprocess.run(
            [sys.executable, SWARM, *args, "--run-dir", str(run_dir)],
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )
    except subprocess.TimeoutExpired:
        raise RunFailed(f"swarm.py {' '.join(args)}, within {COMMAND_S:g} s") from None
    if result.returncode:
        raise RunFailed(f"swarm.py {' '.join(args)} failed: {result.stdout}{result.stderr}")
    return result.stdout


def all_serving(run_dir: Path, workers: int) -> bool:
    path = run_dir / "swarm.json"
    if not path.exists():
        return False
    try:
        members = json.loads(path.read_text())["members"]
    except (json.JSONDecodeError, KeyError):  # mid-write
        return False
    placed = [m for m in members if m["role"] == "worker" and m["stage"] is not None and m["address"]]
    return len(placed) >= workers


def run_swarm(args, run_dir: Path, *, churn: random.Random | None, stages: int, deadline_s: float) -> Outcome:
    """One `swarm.py up` to its end; with ``churn``, a worker killed and one added on a schedule."""
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier run's swarm.json would read as this one's
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}.out"
    flags = ["--replicas", str(args.replicas), "--samples", str(args.samples), "--no-monitor"]
    flags += [
        "--config",
        str(args.config),
        "--shards",
        str(args.shards),
        "--run-dir",
        str(run_dir),
        "--export",
    ]
    kills: list[int] = []
    deadline = time.monotonic() + deadline_s
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, SWARM, "up", *flags], stdout=out, stderr=subprocess.STDOUT)
        try:
            _harness.waiting_for(f"{run_dir.name}: every worker serving ({log})")
            started = time.monotonic() + START_S
            while not all_serving(run_dir, stages * args.replicas):
                if proc.poll() is not None or time.monotonic() > started:
                    raise RunFailed(f"every worker serving, within {START_S:g} s; see {log}")
                time.sleep(0.5)
            while churn is not None and completed(run_dir) < args.settle_samples:
                if wait_or_end(proc, 0.5, deadline):
                    break
            stage = churn.randrange(stages) if churn else 0
            kill_at = time.monotonic()
            _harness.waiting_for(f"{run_dir.name}: `swarm.py up` to end, its export and evaluation ({log})")
            while churn is not None and proc.poll() is None:
                # Kills keep their pace however long an add takes (it returns once the newcomer
                # serves): one every interval, the add half an interval after it.
                interval = args.interval * churn.uniform(0.75, 1.25)
                if wait_or_end(proc, kill_at - time.monotonic(), deadline):
                    break
                if not churn_command(proc, log, run_dir, "kill-worker", stage):
                    break
                kills.append(stage)
                if wait_or_end(proc, kill_at + interval / 2 - time.monotonic(), deadline):
                    break
                if not churn_command(proc, log, run_dir, "add-worker", stage):
                    break
                stage, kill_at = (stage + 1) % stages, kill_at + interval
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RunFailed(f"the run's end, within {deadline_s:g} s; see {log}") from None
        finally:
            # down always: an add-worker cut short may have started a node `up` never knew of
            stop_up(proc, run_dir, down=True)
    text = log.read_text()
    if proc.returncode:
        raise RunFailed(f"`swarm.py up` exited {proc.returncode}; see {log}")
    found = re.search(r"held-out loss: ([0-9.]+) nats/token", text)
    if found is None:
        raise RunFailed(f"no held-out loss in {log}")
    outcome = Outcome(held_out=float(found.group(1)), losses=read_losses(run_dir), kills=kills)
    read_logs(run_dir, outcome)
    return outcome


def completed(run_dir: Path) -> int:
    """Samples the trainer completed so far (lines of its loss log)."""
    path = run_dir / "trainer-0.losses.jsonl"
    return path.read_bytes().count(b"\n") if path.exists() else 0


def churn_command(proc: subprocess.Popen, log: Path, run_dir: Path, command: str, stage: int) -> bool:
    """``swarm.py COMMAND STAGE``; False if it failed because the run was ending meanwhile
    (its trainers done, `up` stopping its nodes), RunFailed if it failed otherwise."""
    try:
        swarm_command(run_dir, command, str(stage))
        return True
    except RunFailed:
        if proc.poll() is not None or "trainers finished" in log.read_text(errors="replace"):
            return False
        raise


def wait_or_end(proc: subprocess.Popen, seconds: float, deadline: float) -> bool:
    """Wait ``seconds``; True if the run ended meanwhile (or its deadline came)."""
    until = min(time.monotonic() + seconds, deadline)
    while time.monotonic() < until:
        if proc.poll() is not None:
            return True
        time.sleep(0.2)
    return proc.poll() is not None or time.monotonic() >= deadline


def read_losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = []
    for line in (run_dir / "trainer-0.losses.jsonl").read_text().splitlines():
        if line.endswith("}"):
            record = json.loads(line)
            rows.append((int(record["id"]), float(record["loss"])))
    return rows


def read_logs(run_dir: Path, outcome: Outcome) -> None:
    for path in (run_dir / "logs").glob("worker-*.log"):
        stage = None
        for line in path.read_text(errors="replace").splitlines():
            if "optimizer_step" in line:
                found = re.search(r"\bsamples=(\d+)", line)
                outcome.largest_step = max(outcome.largest_step, int(found.group(1)) if found else 0)
            elif "worker_resync" in line:
                outcome.resyncs += 1
                outcome.refused += "cause=step_refused" in line
            elif "worker_started" in line:
                found = re.search(r"\bstage=(\d+)", line)
                stage = int(found.group(1)) if found else None
            elif "phase=serving previous=optimizer_sync" in line:
                outcome.joins_served += 1
                if stage is not None:
                    outcome.joined_stages.add(stage)
    for path in (run_dir / "logs").glob("trainer-*.log"):
        outcome.outliers += path.read_text(errors="replace").count("worker_loss_outlier")


def worst_window(losses: list[float]) -> float:
    """The largest mean of 64 consecutive samples after the first 512 over the 64 before it."""
    values = np.asarray(losses, dtype=np.float64)
    sums = np.concatenate([[0.0], np.cumsum(values)])
    means = (sums[WINDOW:] - sums[:-WINDOW]) / WINDOW  # means[i]: samples i .. i + 63
    starts = np.arange(max(SETTLE, WINDOW), len(values) - WINDOW + 1)
    # 0 when a run is too short for one window after the first 512 (--smoke): none was judged
    return float(np.max(means[starts] / means[starts - WINDOW])) if len(starts) else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--samples", type=int, default=6144)
    parser.add_argument("--interval", type=float, default=12.0, help="seconds between kills")
    parser.add_argument(
        "--settle-samples",
        type=int,
        default=SETTLE,
        help="kills begin once the trainer completed this many samples (the learning-rate warm-up behind)",
    )
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "tiny.toml")
    parser.add_argument("--shards", type=Path, help="data shards (default: the main job's, made if missing)")
    parser.add_argument("--work-dir", type=Path, default=ROOT / "runs" / "join_churn")
    _harness.add_arguments(parser, deadline_s=FULL_DEADLINE_S)
    smoke = {"seeds": 1, "samples": SMOKE_SAMPLES, "settle_samples": 16, "interval": 2.0, "replicas": 2}
    args = _harness.parse(parser, smoke=smoke)
    report = Report("join_churn", as_json=args.json)
    run = load_run_config(args.config)
    args.shards = args.shards or default_shards_dir(run.data)
    stages = run.model.n_stages
    deadline_s = START_S + MARGIN_S + args.samples / 5.0  # 5 samples/s: far below any machine's rate
    try:
        worst: dict[str, float] = {"lost": 0, "twice": 0, "window": 0.0, "held_out_ratio": 0.0, "step": 0}
        outcomes = []
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            report.note(f"seed {seed}: churn run of {args.samples} samples ...")
            outcome = run_swarm(
                args, args.work_dir / f"churn-{seed}", churn=random.Random(seed), stages=stages,
                deadline_s=deadline_s,
            )  # fmt: skip
            outcomes.append((seed, outcome))
        report.note("calm run ...")
        calm = run_swarm(args, args.work_dir / "calm", churn=None, stages=stages, deadline_s=deadline_s)
    except RunFailed as exc:
        print(f"join_churn: {exc}", file=sys.stderr)
        return 1
    expected = reading_order(
        open_shard_set(args.shards, "train").shards, run.model.seq_len, run.data.shuffle_seed, args.samples
    )
    for seed, outcome in outcomes:
        ids = [i for i, _ in outcome.losses]
        lost, twice = len(set(expected) - set(ids)), len(ids) - len(set(ids))
        window = worst_window([loss for _, loss in outcome.losses])
        ratio = outcome.held_out / calm.held_out
        for name, value in (("lost", lost), ("twice", twice), ("window", window), ("held_out_ratio", ratio)):
            worst[name] = max(worst[name], value)
        worst["step"] = max(worst["step"], outcome.largest_step)
        prefix = f"seed {seed}"
        report.add(f"{prefix} samples lost", lost, "samples", target="0")
        report.add(f"{prefix} samples completed twice", twice, "samples", target="0")
        report.add(f"{prefix} worst window after {SETTLE}", window, "x the window before", target="<= 1.5")
        report.compare(
            f"{prefix} held-out loss", outcome.held_out, calm.held_out, "nats/token", target="<= 1.05"
        )
        report.add(f"{prefix} largest step", outcome.largest_step, "samples", ratio=outcome.largest_step / run.optimizer.target_batch_size)  # fmt: skip
        report.add(f"{prefix} kills", len(outcome.kills), f"workers (stages {sorted(set(outcome.kills))})")
        report.add(f"{prefix} joins served", outcome.joins_served, "workers")
        report.add(
            f"{prefix} stages joined", len(outcome.joined_stages), f"stages of {stages}", target=f"{stages}"
        )
        report.add(f"{prefix} steps refused", outcome.refused, "steps")
        report.add(f"{prefix} resyncs", outcome.resyncs, "workers")
        report.add(f"{prefix} loss outliers excluded", outcome.outliers, "workers")
    report.add("stages", stages, "stages")
    report.add("target batch", run.optimizer.target_batch_size, "samples")
    report.add("calm held-out loss", calm.held_out, "nats/token")
    report.add("calm largest step", calm.largest_step, "samples")
    report.add("worst samples lost", worst["lost"], "samples", target="0")
    report.add("worst samples completed twice", worst["twice"], "samples", target="0")
    report.add("worst window", worst["window"], "x the window before", target="<= 1.5")
    report.add("worst held-out vs calm", worst["held_out_ratio"], "x", target="<= 1.05")
    report.add(
        "largest step", worst["step"], "samples", ratio=worst["step"] / run.optimizer.target_batch_size
    )
    report.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
