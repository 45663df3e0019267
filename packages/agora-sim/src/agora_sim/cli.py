"""Simulate a run in virtual time: Agora's own code on a simulated network, from a seed.

    agora-sim run SCENARIO.toml [--seed N] [--json] [--plot timeline.png]
    agora-sim search [--seeds 100] [--start 0] [--json]    # random faults
    agora-sim search --replay SEED                          # one of them again
    agora-sim search --swarm [--seeds 100]       # whole swarms, random faults

(``python tools/simulate.py`` and ``python -m agora_sim`` are the same command.)
The scenario (TOML, see ``agora_sim.scenario`` and ``examples/sim/``) says how many
members, their links, the churn and the measured load. The report: join and settle times,
store/get latency as a member sees it, failed and missed operations, members over time, the
trace digest (the same scenario and seed give the same digest, bit for bit) and how much
faster than real time it ran. --plot draws the timeline with matplotlib. ``search`` runs
random scenarios with random faults (``agora_sim.search``), checks the invariants
(``agora_sim.invariants``) after each, and prints each failing seed with the command that
replays it; it exits 1 when any failed. The process runs
with PYTHONHASHSEED=0 (it restarts itself with it when unset), so a digest replays across
processes. A scenario with a ``[swarm]`` table runs real workers and trainers too
(``agora_sim/swarm.py``): tokens/s, per-stage utilization, the bottleneck, averaging, samples
lost. ``search --swarm`` runs random swarm scenarios (``agora_sim/swarm_search.py``) and
checks, once each has settled, that no sample was lost or completed twice, that each stage's
replicas agree after a clean averaging round, and that nothing was left queued or open.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tomllib
from pathlib import Path

import click

from agora_core.observability.logs import configure_logging
from agora_sim.dht_run import DhtRunResult, run_dht_scenario
from agora_sim.scenario import ScenarioError, load_scenario
from agora_sim.search import search_one


def _fixed_hash_seed() -> None:
    """Set iteration order follows the hash seed: restart with a fixed one so a seed replays."""
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.environ["PYTHONHASHSEED"] = "0"
        os.execv(sys.executable, [sys.executable, *sys.argv])


def plot_timeline(result: DhtRunResult, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.ClickException("--plot needs matplotlib (pip install matplotlib)") from None
    times = [s.time_s for s in result.timeline]
    figure, (members, latency) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    members.step(times, [s.members for s in result.timeline], where="post")
    members.set_ylabel("live members")
    members.set_title(f"DHT, {result.scenario.members} members, seed {result.scenario.seed}")
    latency.plot(
        times, [s.get_p50_s * 1000 if s.get_p50_s is not None else float("nan") for s in result.timeline]
    )
    latency.set_ylabel("get p50 (ms)")
    latency.set_xlabel("virtual time (s)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Deterministic simulation of an Agora run."""


@main.command()
@click.argument("scenario_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--seed", type=int, default=None, help="Override the scenario's [run] seed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the results.")
@click.option(
    "--plot", type=click.Path(dir_okay=False, path_type=Path), default=None, help="Draw the timeline (PNG)."
)
def run(scenario_file: Path, seed: int | None, as_json: bool, plot: Path | None) -> None:
    """Run SCENARIO_FILE and report what it measured."""
    _fixed_hash_seed()
    configure_logging(level="error")  # the nodes' own logs would drown the report
    try:
        data = tomllib.loads(scenario_file.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise click.ClickException(f"cannot read scenario {scenario_file}: {exc}") from None
    if "swarm" in data:
        if plot is not None:
            raise click.ClickException("--plot draws DHT scenarios' timelines so far, not a [swarm]'s")
        run_swarm(data, scenario_file, seed, as_json)
        return
    try:
        scenario = load_scenario(scenario_file)
    except ScenarioError as exc:
        raise click.ClickException(str(exc)) from None
    if seed is not None:
        scenario = scenario.with_seed(seed)
    if not as_json:
        click.echo(
            f"simulating {scenario.members} DHT members for {scenario.duration_s:g} virtual s (seed {scenario.seed})"
        )
    result = run_dht_scenario(scenario)
    summary = result.summary()
    if plot is not None:
        plot_timeline(result, plot)
        summary["plot"] = str(plot)
    if as_json:
        summary["timeline"] = [vars(s) for s in result.timeline]
        click.echo(json.dumps(summary))
    else:
        for name, value in summary.items():
            click.echo(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")
        click.echo(f"replay: agora-sim run {scenario_file} --seed {scenario.seed}")
    if result.violations:
        sys.exit(1)


def run_swarm(data: dict, scenario_file: Path, seed: int | None, as_json: bool) -> None:
    """A [swarm] scenario: workers and trainers too (see agora_sim/swarm.py)."""
    from agora_sim.swarm import parse_swarm, run_swarm_scenario  # torch: only where workers run

    try:
        scenario = parse_swarm(data)
    except ScenarioError as exc:
        raise click.ClickException(str(exc)) from None
    if seed is not None:
        scenario = dataclasses.replace(scenario, seed=seed)
    if not as_json:
        click.echo(
            f"simulating {scenario.stages} stages x {scenario.workers_per_stage} workers, {scenario.trainers} "
            f"trainer(s), for {scenario.duration_s:g} virtual s (seed {scenario.seed})"
        )
    summary = run_swarm_scenario(scenario, progress=lambda line: click.echo(line, err=True)).summary
    if as_json:
        click.echo(json.dumps(summary))
    else:
        for name, value in summary.items():
            click.echo(f"{name}: {value:.4g}" if isinstance(value, float) else f"{name}: {value}")
        click.echo(f"replay: agora-sim run {scenario_file} --seed {scenario.seed}")
    if summary["lost"]:
        sys.exit(1)


# what a search adds up over its seeds (each kind's own; the other's are absent)
TOTALLED = ("members", "virtual_s", "joins", "departures", "partitions", "silences", "ops", "missed_reads",
            "worker_joins", "worker_departures", "slowdowns", "completed", "averaging_rounds", "final_rounds", "agreed_stages",
            "across_trainers_twice", "trainer_crashes", "crashed_trainers_held", "authorized",
            "credential_refreshes", "worker_joins_failed", "trainer_restarts_refused")  # fmt: skip


@main.command()
@click.option(
    "--seeds", type=click.IntRange(min=1), default=100, show_default=True, help="How many seeds to run."
)
@click.option("--start", type=click.IntRange(min=0), default=0, show_default=True, help="The first seed.")
@click.option(
    "--replay", type=click.IntRange(min=0), default=None, help="Run this one seed and report it in full."
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object at the end.")
@click.option(
    "--swarm", "whole_swarms", is_flag=True, help="Random swarms (workers, trainers) instead of DHTs."
)
def search(seeds: int, start: int, replay: int | None, as_json: bool, whole_swarms: bool) -> None:
    """Run random scenarios with random faults; check the invariants after each."""
    _fixed_hash_seed()
    configure_logging(level="error")
    if whole_swarms:
        from agora_sim.swarm_search import swarm_search_one as one  # torch: only where workers run
    else:
        one = search_one
    chosen = [replay] if replay is not None else list(range(start, start + seeds))
    failed: list[int] = []
    checked = 0
    totals: dict[str, float] = {}
    for seed in chosen:
        outcome = one(seed)
        checked += 1
        summary = outcome.summary()
        for name in TOTALLED:
            if isinstance(summary.get(name), int | float):
                totals[name] = totals.get(name, 0) + summary[name]
        if outcome.failed:
            failed.append(seed)
        if not as_json:
            click.echo(outcome.line())
            if replay is not None:
                for name, value in summary.items():
                    click.echo(f"  {name}: {value}")
    if as_json:
        click.echo(json.dumps({"seeds": checked, "first": chosen[0], "failed": failed, "totals": totals}))
    else:
        click.echo(f"{checked} seeds, {len(failed)} failed" + (f": {failed}" if failed else ""))
        click.echo("totals: " + ", ".join(f"{name} {value:.0f}" for name, value in totals.items()))
    if failed:
        sys.exit(1)
