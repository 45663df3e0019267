#!/usr/bin/env python3
"""The simulator against the published run: its shape, its observations, our figures.

    python benchmarks/sim_calibration.py [--seconds 60] [--lanes 6 12 18 24] [--workers-per-stage 6]
                                         [--averaging small wire_matched wire_matched_window]
                                         [--json] [--smoke]

Three observations of the report (sections 3.4 and 5), each measured on the scenarios of
``examples/sim/calibration/`` (real workers and trainers in virtual time, ``agora_sim/swarm.py``):

1. Saturation and the bottleneck's utilization. The report adds trainers until the marginal
   gain in tokens/s diminishes (3.4.4) and then reads its bottleneck (the tail, paced by its
   compute) at 87.4 % utilization. Here: ``pipeline.toml`` (7 stages, the tail 1.6x a body's
   cost, 6 workers a stage of mixed speeds, the report's consumer links) with 4 trainers of
   6, 12, 18 and 24 lanes; the saturation point is the first whose next step adds under 10 %
   tokens/s, and the figure is the bottleneck's utilization there.
2. Throughput through churn. The report held its tokens/s through 669 joins and 607
   departures. Here: ``pipeline_churn.toml`` (6 deaths and 6 joins a minute, joiners
   downloading their stage's state) at the saturation point, as a ratio of the calm run's.
3. Averaging at high latency. The report's all-reduce took > 2.5x as long at 120 ms round
   trips as at 0 ms, at 200 Mbit/s, on Pluralis-8B's payload (5 % of a stage's ~1.2 B
   weights a round: ~245 MB, ~10 s on the wire). Here: 2 stages x 4 workers on 200 Mbit/s
   links at 0.1 and 120 ms round trips, averaging every 2 steps, with (a) 2 M averaged
   parameters a stage (100 k a round: the wire takes milliseconds) and (b) the report's
   wire's share kept by scaling the link down with the payload (20 M a stage, 1 M a round:
   each peer sends and receives 6 MB a round, ~5 s at 10 Mbit/s). The figures are medians over
   the rounds that averaged with someone, 120 ms over 0.1 ms: of the whole round (with its
   matchmaking window) and of the all-reduce once the group formed (what the report's
   stability tests time, 3.5.2). Without a TCP window (a and b) a stream is paced by
   bandwidth alone, so latency costs a round only its round trips (matchmaking, each chunk's
   request and reply). (c) adds the window that makes a real
   120 ms path slow: a connection moves at most a window per round trip. At the report's
   shape (20 peers: 19 streams each way, 200 Mbit/s, 120 ms) Linux's default starting
   window of 64 KB caps a peer at 19 x 64 KB / 0.12 s ~ 83 Mbit/s, 0.415 of its link; here
   (3 streams, 10 Mbit/s) the same share takes a window of 0.415 x 1.25 MB/s x 0.12 s / 3
   ~ 20 KB, so (c) is (b) with ``window_kb = 20`` on every host. At 0.1 ms the window allows
   200 MB/s a stream: no cap, so the baseline is unchanged.

The baseline of each ratio is measured in the same run. Figures, never a failure on time.

``--smoke``: 3 virtual seconds of each run, at 6 and 12 lanes, 2 workers a stage, and the small
averaging case only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tomllib
from pathlib import Path

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.observability.logs import configure_logging
from agora_sim.dht_swarm import LinkRange
from agora_sim.swarm import SwarmScenario, parse_swarm, run_swarm_scenario

ROOT = Path(__file__).resolve().parent.parent

CALIBRATION = ROOT / "examples" / "sim" / "calibration"
LANES = (6, 12, 18, 24)
SATURATED_GAIN = 0.10  # a step of lanes adding less than this is past the saturation point


def _scenario(name: str, workers_per_stage: int | None = None, **changes) -> SwarmScenario:
    """``name``'s scenario with ``changes``; ``workers_per_stage`` None: the file's."""
    scenario = parse_swarm(tomllib.loads((CALIBRATION / name).read_text()))
    if workers_per_stage is not None:
        changes["workers_per_stage"] = workers_per_stage
    return dataclasses.replace(scenario, **changes)


def saturation(args: argparse.Namespace, report: Report) -> tuple[int, dict]:
    runs = []
    for lanes in args.lanes:
        report.note(f"pipeline.toml with 4 trainers of {lanes} lanes, {args.seconds:g} virtual s")
        scenario = _scenario("pipeline.toml", args.workers_per_stage, lanes=lanes, duration_s=args.seconds)
        summary = run_swarm_scenario(scenario).summary
        runs.append((lanes, summary))
        report.note(
            f"{4 * lanes} lanes: {summary['tokens_per_s']:.0f} tokens/s, bottleneck stage "
            f"{summary['bottleneck_stage']} at {max(summary['stage_utilization']):.3f} "
            f"({summary['virtual_s_per_real_s']:.2f}x real time)"
        )
    chosen = runs[-1]
    for (lanes, summary), (_, following) in itertools.pairwise(runs):
        if following["tokens_per_s"] < summary["tokens_per_s"] * (1 + SATURATED_GAIN):
            chosen = (lanes, summary)
            break
    lanes, summary = chosen
    report.add("saturation_lanes", 4 * lanes, "lanes")
    report.add("saturated_tokens_per_s", summary["tokens_per_s"], "tokens/s")
    report.add("bottleneck_stage", summary["bottleneck_stage"], "stage (6: the tail)")
    report.add(
        "bottleneck_utilization", max(summary["stage_utilization"]), "fraction", target="report: 0.874"
    )
    report.note("utilization by stage: " + ", ".join(f"{u:.3f}" for u in summary["stage_utilization"]))
    return lanes, summary


def churn(lanes: int, calm: dict, args: argparse.Namespace, report: Report) -> None:
    report.note(f"pipeline_churn.toml at 4 trainers of {lanes} lanes, {args.seconds:g} virtual s")
    scenario = _scenario("pipeline_churn.toml", args.workers_per_stage, lanes=lanes, duration_s=args.seconds)
    summary = run_swarm_scenario(scenario).summary
    report.note(
        f"churn: {summary['worker_departures']} deaths, {summary['worker_joins']} joins "
        f"({summary['joiners_ready']} ready), {summary['tokens_per_s']:.0f} tokens/s, {summary['lost']} lost"
    )
    report.compare(
        "churn_tokens_per_s", summary["tokens_per_s"], calm["tokens_per_s"], "tokens/s", target="report: held"
    )
    report.add("churn_samples_lost", summary["lost"], "samples")


AVERAGING_CASES = (  # label, averaged parameters a stage, link Mbit/s, TCP window KB (None: unlimited)
    ("small", 2_000_000, 200.0, None),
    ("wire_matched", 20_000_000, 10.0, None),
    ("wire_matched_window", 20_000_000, 10.0, 20.0),
)


def averaging(seconds: float, labels: list[str], report: Report) -> None:
    for label, parameters, mbit, window_kb in AVERAGING_CASES:
        if label not in labels:
            continue
        times = {}  # RTT -> (median round, median all-reduce once the group formed)
        for rtt_ms in (0.1, 120.0):
            one_way = rtt_ms / 4  # a path's round trip is 2 x (one way out + one way back)
            links = LinkRange(bandwidth_mbit=(mbit, mbit), one_way_ms=(one_way, one_way), window_kb=window_kb)
            scenario = SwarmScenario(
                seed=1,
                duration_s=seconds,
                stages=2,
                workers_per_stage=4,
                trainers=1,
                lanes=8,
                target_batch_size=16,
                averaging_every_steps=2,
                matchmaking_s=5.0,
                averaged_parameters=parameters,
                links=links,
            )
            report.note(f"averaging {label} at {rtt_ms:g} ms round trips, {seconds:g} virtual s")
            summary = run_swarm_scenario(scenario).summary
            times[rtt_ms] = (summary["averaging_group_round_s"], summary["averaging_allreduce_s"])
            report.note(
                f"averaging {label}, {rtt_ms:g} ms: {summary['averaging_rounds']} rounds, median "
                f"{times[rtt_ms][0]} s ({times[rtt_ms][1]} s once grouped), success {summary['averaging_success']}"
            )
        if all(times[0.1]) and all(times[120.0]):
            for index, part in enumerate(("round", "allreduce")):
                report.compare(
                    f"averaging_{label}_{part}_s_at_120ms",
                    times[120.0][index],
                    times[0.1][index],
                    "s",
                    target="report: > 2.5x",
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="virtual seconds of each run")
    parser.add_argument(
        "--lanes", type=int, nargs="+", default=list(LANES), help="each trainer's lanes, step by step"
    )
    labels = [case[0] for case in AVERAGING_CASES]
    parser.add_argument(
        "--averaging", nargs="+", choices=labels, default=labels, help="the averaging cases to run"
    )
    parser.add_argument(
        "--workers-per-stage", type=int, default=None, help="(1) and (2): instead of the scenario files' 6"
    )
    _harness.add_arguments(parser, deadline_s=1800)
    args = _harness.parse(
        parser, smoke={"seconds": 3.0, "lanes": [6, 12], "averaging": ["small"], "workers_per_stage": 2}
    )
    configure_logging(level="error")
    report = Report("sim_calibration", as_json=args.json)
    lanes, calm = saturation(args, report)
    churn(lanes, calm, args, report)
    averaging(args.seconds, args.averaging, report)
    report.finish()


if __name__ == "__main__":
    main()
