#!/usr/bin/env python3
"""Convergence benchmark: the swarm's loss against the centralized run's on the same samples.

    python benchmarks/convergence.py [--configs tiny narrow] [--replicas 1 2 3]
                                     [--samples 2048 8192] [--rounds 2]
                                     [--ablation-samples 2048] [--no-ablations] [--json] [--smoke]

Every swarm run is ``tools/swarm.py up`` as a user runs it (authorized, one trainer); its
per-sample losses are compared by sample id with ``tools/reference_train.py``'s on the same
config and shards (deterministic, so run once per config and sample count). Figures, each the
median over ``--rounds`` runs:
  * the loss ratio swarm / reference over each quarter of the samples, and the ratio of
    held-out losses (64 validation samples, both models scored the same way);
  * measured in the swarm's worker logs: optimizer steps between a sample's forward and its
    backward (mean over non-tail stages), samples per optimizer step, and the replicas'
    distance at averaging (||average - own|| / ||own|| of the averaged segment) per quarter of
    the rounds;
  * samples/s.

Configs: ``tiny`` (examples/tiny.toml) and ``narrow`` (another seed, width 96, three stages
of 2, 1, 1 blocks), on the main job's shards. The main cases are every config x replicas x
samples in the main job's shape (2 lanes x 4). The ablations (``tiny``, ``--ablation-samples``)
separate the causes:
  * ``lanes``: 1 lane of 8 and 4 lanes of 4 against 2 of 4, one worker per stage: more
    samples in flight, more steps between a forward and its backward;
  * ``delay``: no swarm at all, the reference trained with the main job's 8 samples in
    flight (``_delayed_reference.py``): the delay alone, with the late samples' stale
    gradients dropped (the default) and applied;
  * ``versions``: ``optimizer.weight_versions = 0`` (backwards recompute under the live
    weights), one worker per stage;
  * ``stale gradients``: ``optimizer.stale_gradients = "apply"`` (a backward whose forward
    ran before the last step adds its gradient to the next one), one worker per stage;
  * ``averaging``: two workers per stage averaging at other cadences and fractions (every 5
    steps a quarter or all of the weights, every step all of them) than the config's.
``--smoke``: 16 samples of one config, one worker per stage, one round, the delay ablation.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import _harness
from _churn_swarm import ensure_shards, run_up  # benchmarks/ is on sys.path as a script
from _delayed_reference import delayed_losses
from _report import Report
from agora_core.config import load_run_config
from agora_core.config.run import STALE_GRADIENTS
from agora_localswarm.results import export_command
from agora_model.reference import train as reference_train
from agora_trainer.data.held_out import validation_samples
from agora_trainer.data.shards import open_shard_set
from agora_worker.model.export import read_model
from agora_worker.model.inference import WholeModel, held_out_loss

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "examples" / "tiny.toml"
SHARDS = ROOT / ".agora" / "shards" / "bpe-512"  # the main job's own (tools/swarm.py default)
SWARM_RUN_S = 3600.0  # one `swarm.py up`, start to end
QUOTE = '"'  # a TOML string's, left out of file names
EXPORT_S = 600.0  # exporting its model from the workers' checkpoints
HELD_OUT_SAMPLES = 64
LANES, MICROBATCH = 2, 4  # the main job's (tools/swarm.py up's defaults)
AVERAGING_ABLATIONS = ((5, 4), (5, 1), (1, 1))  # (cadence_steps, segments)
# Settings per config, by [section] and key; every other one is examples/tiny.toml's.
CONFIGS: dict[str, dict[str, dict[str, str]]] = {
    "tiny": {},
    "narrow": {
        "": {"name": '"narrow"', "seed": "4321"},
        "model": {"d_model": "96", "n_heads": "4", "subspace_rank": "12", "stage_layers": "[2, 1, 1]"},
    },
}


def configured(name: str, settings: dict[str, dict[str, str]], folder: Path) -> Path:
    """examples/tiny.toml with ``CONFIGS[name]`` and ``settings`` in place (each key replaced
    in its section, or added at the section's top), written into ``folder``."""
    merged: dict[str, dict[str, str]] = {}
    for source in (CONFIGS[name], settings):
        for section, values in source.items():
            merged.setdefault(section, {}).update(values)
    lines = TINY.read_text().splitlines()
    section = ""
    out: list[str] = []
    pending = dict(merged.get("", {}))
    for line in lines:
        header = re.match(r"\[(\w+)\]", line)
        if header:
            out += [f"{k} = {v}" for k, v in pending.items()]  # keys the last section lacked
            section = header.group(1)
            pending = dict(merged.get(section, {}))
            out.append(line)
            continue
        key = re.match(r"(\w+)\s*=", line)
        if key and key.group(1) in pending:
            out.append(f"{key.group(1)} = {pending.pop(key.group(1))}")
        else:
            out.append(line)
    out += [f"{k} = {v}" for k, v in pending.items()]
    tag = "-".join(f"{k}{v.strip(QUOTE)}" for values in settings.values() for k, v in values.items())
    path = folder / f"{name}{'-' + tag if tag else ''}.toml"
    path.write_text("\n".join(out) + "\n")
    return path


@dataclass
class Reference:
    order: list[int]  # sample ids in training order
    losses: np.ndarray  # per sample, in that order
    held_out: float


@dataclass
class SwarmRun:
    losses: np.ndarray  # per sample, in the reference's order
    held_out: float
    rate: float
    staleness: float | None  # mean steps between forward and backward, non-tail stages
    samples_per_step: float | None
    distance: list[float] = field(default_factory=list)  # mean replica distance per quarter of rounds


def quarters(values: np.ndarray) -> list[float]:
    size = max(1, len(values) // 4)
    return [float(np.mean(values[k * size : (k + 1) * size])) for k in range(4) if len(values[k * size :])]


def score(model_path: Path, run, held_out) -> float:
    return float(
        held_out_loss(WholeModel(read_model(model_path).modules(), seq_len=run.model.seq_len), held_out)
    )


def reference(config: Path, samples: int, folder: Path, held_out, note) -> Reference:
    note(f"reference: {config.name}, {samples} samples")
    log, model = (
        folder / f"{config.stem}-{samples}.losses.jsonl",
        folder / f"{config.stem}-{samples}.safetensors",
    )
    run = load_run_config(str(config))
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines: not into --json's output
        reference_train(run, str(SHARDS), samples, microbatch=16, loss_log=log, every=0, export=model)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return Reference(
        order=[r["id"] for r in rows],
        losses=np.array([r["loss"] for r in rows]),
        held_out=score(model, run, held_out),
    )


LOG_FIELD = re.compile(r"(\w+)=(\S+)")


def log_events(run_dir: Path, event: str) -> list[dict[str, str]]:
    """Every ``event`` line of the swarm's worker logs, as its key=value fields (and 'time')."""
    found = []
    for path in sorted((run_dir / "logs").glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if f" {event} " in line:
                fields = dict(LOG_FIELD.findall(line))
                fields["time"] = line.split(" ", 1)[0]
                found.append(fields)
    return found


def swarm(
    config: Path,
    samples: int,
    replicas: int,
    folder: Path,
    held_out,
    ref: Reference,
    note,
    *,
    lanes=LANES,
    microbatch=MICROBATCH,
) -> SwarmRun:
    run_dir = folder / f"{config.stem}-r{replicas}-l{lanes}x{microbatch}-{samples}"
    note(
        f"swarm: {config.name}, {replicas} workers per stage, {lanes} lanes x {microbatch}, {samples} samples"
    )
    flags = ["--config", str(config), "--shards", str(SHARDS), "--samples", str(samples)]
    flags += ["--replicas", str(replicas), "--lanes", str(lanes), "--microbatch", str(microbatch)]
    # --no-export: the model is scored here, on the reference's held-out samples; up's own
    # evaluation, sample and centralized comparison would only cost time
    flags += ["--no-monitor", "--no-export", "--status-interval", "60"]
    done = run_up(flags, run_dir, timeout_s=SWARM_RUN_S, capture=True)
    found = re.search(r"training throughput: ([\d.]+) samples/s", done.stdout)
    if done.returncode != 0 or not found:
        raise RuntimeError(
            f"swarm.py up failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    model = run_dir / "model.safetensors"
    export = export_command(run_dir, str(config), SHARDS, model)
    exported = subprocess.run(export, capture_output=True, text=True, timeout=EXPORT_S)
    if exported.returncode != 0:
        raise RuntimeError(f"export_model.py failed ({exported.returncode}):\n{exported.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "trainer-0.losses.jsonl").read_text().splitlines()]
    by_id = {r["id"]: r["loss"] for r in rows}
    missing = [i for i in ref.order if i not in by_id]
    if missing:
        raise RuntimeError(f"the swarm in {run_dir} lost {len(missing)} of the reference's samples")
    run = load_run_config(str(run_dir / "run.toml"))
    steps = log_events(run_dir, "optimizer_step")
    stale = [float(s["staleness"]) for s in steps if s.get("staleness", "None") != "None"]
    counts = [int(s["samples"]) for s in steps if s.get("applied") == "True"]
    rounds = sorted(
        (r["time"], float(r["distance"]))
        for r in log_events(run_dir, "averaging_round")
        if int(r.get("group_size", "1")) >= 2 and float(r.get("averaging_success", "0")) > 0
    )
    return SwarmRun(
        losses=np.array([by_id[i] for i in ref.order]),
        held_out=score(model, run, held_out),
        rate=float(found.group(1)),
        staleness=statistics.fmean(stale) if stale else None,
        samples_per_step=statistics.fmean(counts) if counts else None,
        distance=quarters(np.array([d for _, d in rounds])) if len(rounds) >= 4 else [],
    )


def report_case(
    report: Report, name: str, runs: list[SwarmRun], ref: Reference, *, replicas: int | None = None
) -> None:
    """The case's figures: medians over its runs (``replicas``: a main case's, for its
    targets: one worker per stage within 1.5 % every quarter, more within 3 % held out)."""
    theirs = quarters(ref.losses)
    for q, base in enumerate(theirs):
        ours = [quarters(r.losses)[q] for r in runs]
        report.add(
            f"{name}_loss_q{q + 1}",
            statistics.median(ours),
            "nats/token",
            baseline=base,
            ratio=statistics.median([o / base for o in ours]),
            target="ratio <= 1.015" if replicas == 1 else None,
        )
    scored = [r.held_out for r in runs]
    report.add(
        f"{name}_held_out",
        statistics.median(scored),
        "nats/token",
        baseline=ref.held_out,
        ratio=statistics.median([s / ref.held_out for s in scored]),
        target="ratio <= 1.03" if replicas is not None and replicas >= 2 else None,
    )
    report.add(f"{name}_samples_per_s", statistics.median([r.rate for r in runs]), "samples/s")
    for label, values, unit in (
        ("staleness", [r.staleness for r in runs], "steps"),
        ("samples_per_step", [r.samples_per_step for r in runs], "samples"),
    ):
        known = [v for v in values if v is not None]
        if known:
            report.add(f"{name}_{label}", statistics.median(known), unit)
    for q in range(4):
        known = [r.distance[q] for r in runs if len(r.distance) > q]
        if known:
            report.add(f"{name}_replica_distance_q{q + 1}", statistics.median(known), "relative")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 3], help="workers per stage")
    parser.add_argument("--samples", type=int, nargs="+", default=[2048, 8192], help="samples per run")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each swarm case; figures are medians")
    parser.add_argument("--ablation-samples", type=int, default=2048, help="samples of each ablation run")
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True)
    _harness.add_arguments(parser, deadline_s=6 * 3600)
    args = _harness.parse(
        parser,
        smoke={"configs": ["tiny"], "replicas": [1], "samples": [16], "rounds": 1, "ablation_samples": 16},
    )
    report = Report("convergence", as_json=args.json)
    largest = max([*args.samples, args.ablation_samples])
    report.note(f"the main job's shards, for {largest} samples")
    ensure_shards(SHARDS, str(TINY), largest)
    held_out = validation_samples(
        open_shard_set(str(SHARDS), "validation"), load_run_config(str(TINY)).model.seq_len, HELD_OUT_SAMPLES
    )
    with tempfile.TemporaryDirectory(prefix="agora-convergence-") as tmp:
        folder = Path(tmp)
        references: dict[tuple[Path, int], Reference] = {}

        def ref_for(config: Path, samples: int) -> Reference:
            if (config, samples) not in references:
                references[config, samples] = reference(config, samples, folder, held_out, report.note)
            return references[config, samples]

        def case(
            name: str, config: Path, samples: int, replicas: int, *, main: bool = False, **shape
        ) -> None:
            ref = ref_for(config, samples)
            runs = []
            for index in range(args.rounds):
                here = folder / f"{name}-{index}"
                here.mkdir()
                runs.append(swarm(config, samples, replicas, here, held_out, ref, report.note, **shape))
            report_case(report, name, runs, ref, replicas=replicas if main else None)

        for config_name in args.configs:
            config = configured(config_name, {}, folder)
            for samples in args.samples:
                for replicas in args.replicas:
                    case(f"{config_name}_r{replicas}_{samples}", config, samples, replicas, main=True)
        if args.ablations:
            tiny, samples = configured("tiny", {}, folder), args.ablation_samples
            ref = ref_for(tiny, samples)
            run = load_run_config(str(tiny))
            for policy in STALE_GRADIENTS:
                report.note(
                    f"delay: the reference with {LANES * MICROBATCH} samples in flight, stale gradients {policy}"
                )
                delayed_run = dataclasses.replace(
                    run, optimizer=dataclasses.replace(run.optimizer, stale_gradients=policy)
                )
                delayed = np.array(delayed_losses(delayed_run, str(SHARDS), samples, LANES * MICROBATCH))
                for q, (ours, base) in enumerate(zip(quarters(delayed), quarters(ref.losses), strict=True)):
                    report.add(
                        f"delay_{LANES * MICROBATCH}_in_flight_{policy}_loss_q{q + 1}",
                        ours,
                        "nats/token",
                        baseline=base,
                        ratio=ours / base,
                    )
            if not args.smoke:
                for lanes, microbatch in ((1, 8), (4, 4)):
                    case(
                        f"lanes_{lanes}x{microbatch}_r1", tiny, samples, 1, lanes=lanes, microbatch=microbatch
                    )
                unversioned = configured("tiny", {"optimizer": {"weight_versions": "0"}}, folder)
                case("weight_versions_0_r1", unversioned, samples, 1)
                applied = configured("tiny", {"optimizer": {"stale_gradients": '"apply"'}}, folder)
                case("stale_gradients_apply_r1", applied, samples, 1)
                averaging = run.averaging
                for cadence, segments in AVERAGING_ABLATIONS:
                    if (cadence, segments) == (averaging.cadence_steps, averaging.segments):
                        continue  # the main cases' own
                    every = {"averaging": {"cadence_steps": str(cadence), "segments": str(segments)}}
                    case(
                        f"cadence_{cadence}_segments_{segments}_r2",
                        configured("tiny", every, folder),
                        samples,
                        2,
                    )
    report.finish()


if __name__ == "__main__":
    main()
