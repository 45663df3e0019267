#!/usr/bin/env python3
"""Byzantine joiners: one worker that lies joins a training swarm mid-run.

    python benchmarks/byzantine.py [--json] [--attacks scaled,sign_flip,noise,push,weight,progress]
                                   [--samples 2048] [--stage 1] [--replicas 2] [--lanes 4]
                                   [--turn-after 8]
                                   [--config examples/tiny.toml] [--shards DIR] [--smoke]

Each run is the main job's swarm (authorized, monitored; ``--replicas`` workers per stage,
one trainer) training ``--samples`` samples. Once a quarter of them are done, one more worker
is admitted to ``--stage``: an honest one in the baseline run, then, one run per attack, a
worker that tells one lie and is otherwise honest
(``agora_devkit.attacker``; it lies once it took part in ``--turn-after`` rounds honestly, past
the sync phases and the probation that send a joiner lying from its first round back to
sync): ``scaled`` values (x3), ``sign_flip``, ``noise`` at the values'
own RMS, ``push`` (a small step in one direction every round), ``weight`` (a declared weight
of 1e9 samples), ``progress`` (stage progress 1000 steps ahead of its own); and three that
lie in what they compute for the trainer, once they served ``--turn-after`` forwards honestly:
``garbage`` (random outputs), ``zeros``, ``stale`` (forwards from the weights it held when it
turned). The joiner makes its stage ``--replicas`` + 1 strong. Figures per attack:

- ``<attack>.loss_ratio``: the trainer's mean loss over the last quarter of the samples, vs
  the honest baseline's over the same samples (target <= 1.05);
- ``<attack>.clips_of_attacker``: averaging clips (``averaging_clipped`` lines) in the honest
  workers' logs that name the attacker, and ``<attack>.clips_of_honest`` those that name an
  honest worker;
- ``<attack>.spot_check_failures``: the trainer's settled spot-check mismatches against the
  attacker (``spot_check_mismatch`` lines), and ``<attack>.spot_check_failures_of_honest``
  those against an honest worker (target 0);
- ``<attack>.attacker_revoked``: 1 when the authorizer revoked its credential on its honest
  peers' accusations before the run ended (target 1), ``<attack>.seconds_to_revocation``
  how long after it started serving, and ``<attack>.honest_revoked`` the honest workers
  revoked (target 0).

``--smoke``: one stage replica, 48 samples, the ``scaled`` attack only and no baseline run.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from pathlib import Path

import _harness
from _churn_logs import log_lines, read_losses
from _churn_swarm import ROOT, DrivenSwarm, load_run_config
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.observability.logs import configure_logging
from agora_devkit.attacker import ATTACKS
from agora_localswarm.cli import default_shards_dir

TRAINER_START_S = 300.0  # swarm up to the trainer's first sample, at most
SAMPLES_PER_S = 1.0  # far below any machine's rate: only a run that hangs is slower
JOINER_S = 180.0  # the joiner admitted, placed and serving
POLL_S = 0.5
REVOKED_EVENT = "node_revoked_by_accusations"  # the authorizer's log line of a revocation


async def one_run(args, report: Report, name: str, program: tuple[str, ...]) -> dict:
    """A swarm that trains ``args.samples`` samples while a worker running ``program`` joins
    ``args.stage`` a quarter of the way in; its losses, logs and the joiner's node id."""
    swarm = DrivenSwarm(Path(args.run_dir) / name, args.config, Path(args.shards), args.replicas, args.lanes)
    report.note(f"{name}: starting the swarm ...")
    try:
        await asyncio.to_thread(swarm.up)
        trainer = await asyncio.to_thread(swarm.start_trainer, args.samples)
        deadline = time.monotonic() + TRAINER_START_S + args.samples / SAMPLES_PER_S
        _harness.waiting_for(f"{name}: a quarter of the samples")
        while len(read_losses(swarm.loss_log())) < args.samples // 4:
            if trainer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the trainer ended or stalled before a quarter of its samples")
            await asyncio.sleep(POLL_S)
        report.note(f"{name}: a worker joins stage {args.stage} ({' '.join(program)})")
        member, proc = await asyncio.to_thread(swarm.start_worker, args.stage, program)
        _harness.waiting_for(f"{name}: the joiner serving")
        await asyncio.wait_for(asyncio.to_thread(swarm.wait_serving, member, proc), JOINER_S)
        serving_at = time.monotonic()
        _harness.waiting_for(f"{name}: the trainer's last sample")
        revoked_after = None
        while trainer.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: the trainer to finish {args.samples} samples")
            if revoked_after is None and member.node_id in revoked_nodes(swarm):
                revoked_after = time.monotonic() - serving_at
            await asyncio.sleep(POLL_S)
        if revoked_after is None and member.node_id in revoked_nodes(swarm):
            revoked_after = time.monotonic() - serving_at
    finally:
        await asyncio.to_thread(swarm.down)
    honest_logs = [p for p in swarm.logs("worker") if p.stem != member.name]
    workers = [m.node_id for m in swarm.swarm.members if m.role == "worker" and m.node_id]
    clips = [set(re.findall(r"[0-9a-f]{12}", line)) for line in log_lines(honest_logs, "averaging_clipped")]
    attacker = member.node_id[:12]
    honest = {w[:12] for w in workers} - {attacker}
    failed = [
        found.group(1)[:12]
        for line in log_lines(swarm.logs("trainer"), "spot_check_mismatch")
        if (found := re.search(r"node=([0-9a-f]{40})", line))
    ]
    return {
        "losses": [r["loss"] for r in read_losses(swarm.loss_log())],
        "clips_of_attacker": sum(attacker in ids for ids in clips),
        "clips_of_honest": sum(bool(ids & honest) for ids in clips),
        "checks_failed_by_attacker": failed.count(attacker),
        "checks_failed_by_honest": sum(node in honest for node in failed),
        "revoked_after": revoked_after,
        "honest_revoked": len({w for w in workers if w != member.node_id} & revoked_nodes(swarm)),
    }


def revoked_nodes(swarm: DrivenSwarm) -> set[str]:
    """The node ids the authorizer revoked on accusations so far, by its log."""
    path = swarm.run_dir / "logs" / "authorizer.log"
    lines = log_lines([path], REVOKED_EVENT) if path.exists() else []
    return {node for line in lines for node in re.findall(r"[0-9a-f]{40}", line)}


def last_quarter(losses: list[float], count: int) -> float:
    tail = losses[:count][-max(1, count // 4) :]
    return statistics.fmean(tail) if tail else 0.0


async def main_async(args) -> None:
    report = Report("byzantine", as_json=args.json)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = [a for a in attacks if a not in ATTACKS]
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}: choose from {', '.join(ATTACKS)}")
    baseline = None
    if not args.smoke:
        baseline = await one_run(args, report, "honest", ("agora_worker",))
    for attack in attacks:
        lie = attack if attack == "progress" else f"{attack}@+{args.turn_after}"
        run = await one_run(args, report, attack, ("agora_devkit.attacker", lie))
        count = len(run["losses"]) if baseline is None else min(len(run["losses"]), len(baseline["losses"]))
        ours = last_quarter(run["losses"], count)
        unit = f"mean loss of the last {max(1, count // 4)} of {count} samples"
        if baseline is None:
            report.add(f"{attack}.loss", ours, unit)
        else:
            theirs = last_quarter(baseline["losses"], count)
            report.compare(
                f"{attack}.loss_ratio", ours, theirs, f"{unit} (vs an honest joiner)", target="ratio <= 1.05"
            )
        report.add(f"{attack}.clips_of_attacker", run["clips_of_attacker"], "clip records naming it")
        report.add(
            f"{attack}.clips_of_honest", run["clips_of_honest"], "clip records naming an honest worker"
        )
        report.add(f"{attack}.spot_check_failures", run["checks_failed_by_attacker"], "settled against it")
        report.add(
            f"{attack}.spot_check_failures_of_honest",
            run["checks_failed_by_honest"],
            "settled against an honest worker",
            target="== 0",
        )
        revoked = run["revoked_after"] is not None
        report.add(f"{attack}.attacker_revoked", int(revoked), "revoked before the run ended", target="== 1")
        if revoked:
            report.add(f"{attack}.seconds_to_revocation", round(run["revoked_after"], 1), "s from serving")
        report.add(f"{attack}.honest_revoked", run["honest_revoked"], "honest workers revoked", target="== 0")
    report.finish()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated")
    parser.add_argument("--samples", type=int, default=2048, help="samples each run trains")
    parser.add_argument("--stage", type=int, default=1, help="the stage the joiner serves")
    parser.add_argument("--config", default=str(ROOT / "examples" / "tiny.toml"))
    parser.add_argument(
        "--shards", help="made if missing (default: the main job's, for the config's tokenizer)"
    )
    parser.add_argument("--replicas", type=int, default=2, help="workers per stage before the joiner")
    parser.add_argument("--lanes", type=int, default=4, help="the trainer's samples in flight")
    parser.add_argument(
        "--turn-after",
        type=int,
        default=8,
        help="averaging rounds the attacker takes part in honestly (its sync and probation); "
        "for a compute lie, forwards it serves honestly",
    )
    parser.add_argument("--run-dir", default=str(ROOT / "runs" / "byzantine"), help="where the runs live")
    _harness.add_arguments(parser, deadline_s=3600)
    args = _harness.parse(parser, smoke={"attacks": "scaled", "samples": 48, "replicas": 1, "lanes": 2})
    if args.shards is None:
        args.shards = str(default_shards_dir(load_run_config(args.config).data))
    configure_logging(fmt="console", level="warning")
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
