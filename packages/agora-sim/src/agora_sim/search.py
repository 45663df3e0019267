"""Fault search: random scenarios with random faults, each from one seed, invariants checked.

A seed decides everything: the swarm's size, its links (bandwidth, latency, jitter, TCP loss),
churn, partitions, silent hosts, clock skew within the run's limit, the load, and then (as the
scenario's own seed) every choice the simulation makes. A failing seed therefore replays
exactly: ``agora-sim search --replay SEED``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from agora_core.config.run import DhtConfig
from agora_sim.dht_run import DhtRunResult, run_dht_scenario
from agora_sim.dht_swarm import LinkRange
from agora_sim.scenario import Churn, Faults, Scenario


def random_links(
    rng: random.Random, low_mbit: float, near_ms: float, *, losses: tuple[float, ...]
) -> LinkRange:
    """Links from ``low_mbit`` up to 10x that, ``near_ms`` up to 60 ms more one way, some
    jitter, a TCP loss rate of ``losses`` (the fault searches' common draw)."""
    return LinkRange(
        bandwidth_mbit=(low_mbit, low_mbit * rng.choice([1.0, 4.0, 10.0])),
        one_way_ms=(near_ms, near_ms + rng.uniform(0.0, 60.0)),
        jitter_ms=rng.choice([0.0, 1.0, 5.0]),
        loss=rng.choice(losses),
    )


def random_scenario(seed: int) -> Scenario:
    rng = random.Random(f"agora-fault-search-{seed}")
    low_mbit = rng.choice([10.0, 50.0, 100.0])
    near_ms = rng.uniform(0.5, 20.0)
    return Scenario(
        seed=seed,
        members=rng.randint(4, 40),
        duration_s=rng.uniform(30.0, 120.0),
        sample_s=10.0,
        links=random_links(rng, low_mbit, near_ms, losses=(0.0, 0.0, 0.001, 0.01, 0.05)),
        churn=Churn(joins_per_min=rng.uniform(0.0, 8.0), departures_per_min=rng.uniform(0.0, 8.0)),
        ops_per_s=rng.uniform(0.5, 3.0),
        faults=Faults(
            partitions_per_min=rng.choice([0.0, 0.0, 0.5, 1.0, 2.0]),
            partition_s=rng.uniform(2.0, 30.0),
            silences_per_min=rng.choice([0.0, 1.0, 3.0]),
            silence_s=rng.uniform(1.0, 20.0),
            # within what the run tolerates: records are refused beyond max_clock_skew_s
            max_clock_skew_s=rng.choice([0.0, 1.0, DhtConfig().max_clock_skew_s / 2]),
        ),
        authorized=rng.random() < 0.3,  # drawn last: the seeds' other draws stay as they were
    )


@dataclass
class SearchOutcome:
    seed: int
    result: DhtRunResult

    @property
    def failed(self) -> bool:
        return bool(self.result.violations)

    def summary(self) -> dict:
        return self.result.summary()

    def line(self) -> str:
        summary = self.result.summary()
        scenario = self.result.scenario
        text = (
            f"seed {self.seed}: {scenario.members} {'authorized ' if scenario.authorized else ''}members, "
            f"{scenario.duration_s:.0f} s, "
            f"{summary['joins']} joins, {summary['departures']} departures, {summary['partitions']} partitions, "
            f"{summary['silences']} silences; {summary['ops']} ops, {summary['missed_reads']} missed while faulty"
        )
        if self.failed:
            text += f"\n  FAILED: {'; '.join(self.result.violations)}\n  replay: agora-sim search --replay {self.seed}"
        return text


def search_one(seed: int) -> SearchOutcome:
    return SearchOutcome(seed, run_dht_scenario(random_scenario(seed)))
