#!/usr/bin/env python3
"""Ablation: pinned backward vs randomly routed backward, under asynchronous averaging.

    python benchmarks/ablation_backward.py [--samples 2048] [--replicas 2] [--config examples/tiny.toml]
                                           [--no-export] [--json] [--smoke]

Runs the same local swarm twice (`tools/swarm.py up`: same seed, same initial weights, same
samples in the same order, replicas averaging every few steps) and changes one thing: where a
sample's backward goes. *Pinned* (Agora's routing) sends it to the worker of each stage that
ran its forward; *random* lets the balancer pick any replica, so the gradient is computed
under weights that did not produce the activations. Prints each run's loss over the last
quarter of the samples (the same samples in both runs) and random over pinned; the paper's
finding is that pinned is not worse. Several minutes on two CPU cores. ``--smoke``: both runs
with one worker per stage and 16 samples, nothing exported.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import _harness
from _churn_swarm import run_up  # benchmarks/ is on sys.path when a benchmark runs as a script
from _report import Report

ROOT = Path(__file__).resolve().parent.parent
SHARDS_S = 300.0  # tools/make_shards.py: learning the BPE and tokenizing 4 MB
UP_START_S = 600.0  # a swarm's start and end around its samples, on a busy two-core machine
SAMPLES_PER_S = 4.0  # far below any machine's rate: only a run that hangs takes longer


def losses_by_id(run_dir: Path) -> np.ndarray:
    records = [json.loads(line) for line in (run_dir / "trainer-0.losses.jsonl").read_text().splitlines()]
    return np.array([r["loss"] for r in sorted(records, key=lambda r: r["id"])])


def swarm_run(args, folder: Path, routing: str, report: Report) -> np.ndarray:
    run_dir = folder / routing
    report.note(f"swarm with {routing} backward: {args.samples} samples ...")
    command = ["--config", args.config]
    command += [
        "--shards",
        str(folder / "shards"),
        "--samples",
        str(args.samples),
        "--replicas",
        str(args.replicas),
    ]
    command += ["--lanes", str(args.lanes), "--status-interval", "30"]
    command += [f"--trainer-arg=--backward-routing={routing}"]
    command += ["--no-export"] if args.no_export else []
    done = run_up(command, run_dir, timeout_s=UP_START_S + args.samples / SAMPLES_PER_S, quiet=args.json)
    if done.returncode != 0:
        raise SystemExit(f"swarm.py up with {routing} backward exited {done.returncode}")
    return losses_by_id(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument(
        "--no-export", action="store_true", help="skip swarm.py up's export and evaluation after each run"
    )
    _harness.add_arguments(parser, deadline_s=3600)
    args = _harness.parse(parser, smoke={"samples": 16, "replicas": 1, "lanes": 2, "no_export": True})
    report = Report("ablation_backward", as_json=args.json)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        make = [sys.executable, str(ROOT / "tools" / "make_shards.py"), str(folder / "shards")]
        make += ["--config", args.config, "--max-mb", "4"]  # the run's tokenizer
        report.note("making shards of 4 MB for the run's tokenizer ...")
        subprocess.run(make, check=True, capture_output=True, timeout=SHARDS_S)
        curves = {routing: swarm_run(args, folder, routing, report) for routing in ("pinned", "random")}
    tail = slice(3 * args.samples // 4, args.samples)
    pinned, randomly = (float(curves[r][tail].mean()) for r in ("pinned", "random"))
    report.add("pinned_final_loss", pinned, "nats/token (last quarter of the samples)")
    report.compare(
        "random_final_loss", randomly, pinned, "nats/token (vs pinned)", target="ratio >= 1: pinned not worse"
    )
    report.finish()


if __name__ == "__main__":
    main()
