"""Fault search over whole swarms: a random scenario per seed, its invariants checked after.

A seed decides the swarm (stages, replicas, trainers, lanes, compute speeds, batch size,
averaging cadence and payload), its links, worker churn, trainer crashes and restarts,
partitions, silent hosts, clock skew within the run's limit and slowed workers, and for 3 in
10 an authorized run (``swarm_auth``); then, as the scenario's own seed, every choice the
simulation makes. What is checked is ``swarm_faults.check_settled``'s list. A failing
seed replays exactly: ``agora-sim search --swarm --replay SEED``.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from agora_core.config.admission import AdmissionConfig
from agora_core.config.run import DhtConfig
from agora_sim.search import random_links
from agora_sim.swarm import SwarmResult, SwarmScenario, run_swarm_scenario
from agora_sim.swarm_faults import SwarmFaults


def random_swarm_scenario(seed: int) -> SwarmScenario:
    rng = random.Random(f"agora-swarm-fault-search-{seed}")
    low_mbit = rng.choice([10.0, 50.0, 100.0])
    near_ms = rng.uniform(0.5, 20.0)
    slow = rng.uniform(0.3, 1.0)
    forward_ms = rng.uniform(1.0, 20.0)
    matchmaking_s = rng.uniform(2.0, 10.0)
    scenario = SwarmScenario(
        seed=seed,
        duration_s=rng.uniform(20.0, 60.0),
        stages=rng.randint(2, 4),
        workers_per_stage=rng.randint(1, 3),
        trainers=rng.choice([1, 1, 2]),
        lanes=rng.randint(1, 6),
        forward_ms=forward_ms,
        backward_ms=forward_ms * rng.uniform(1.5, 3.0),
        speed=(slow, slow * rng.uniform(1.0, 3.0)),
        target_batch_size=rng.choice([4, 8, 16, 32]),
        averaging=rng.random() < 0.9,
        averaging_every_steps=rng.randint(1, 4),
        matchmaking_s=matchmaking_s,
        averaged_parameters=rng.choice([0, 0, 20_000]),
        worker_departures_per_min=rng.choice([0.0, 1.0, 3.0, 6.0]),
        worker_joins_per_min=rng.choice([0.0, 1.0, 3.0, 6.0]),
        links=random_links(rng, low_mbit, near_ms, losses=(0.0, 0.0, 0.001, 0.01)),
        faults=SwarmFaults(
            partitions_per_min=rng.choice([0.0, 0.0, 0.5, 1.0, 2.0]),
            partition_s=rng.uniform(2.0, 20.0),
            silences_per_min=rng.choice([0.0, 1.0, 3.0]),
            silence_s=rng.uniform(1.0, 15.0),
            max_clock_skew_s=rng.choice([0.0, 1.0, DhtConfig().max_clock_skew_s / 2]),
            slowdowns_per_min=rng.choice([0.0, 1.0, 3.0]),
            slowdown_factor=rng.uniform(2.0, 8.0),
            slowdown_s=rng.uniform(5.0, 20.0),
        ),
        # drawn last, so the seeds searched before trainers crashed keep their other draws;
        # a restart past shard_adopt_after_s (30 s) finds its shard adopted by another trainer
        trainer_crashes_per_min=rng.choice([0.0, 0.0, 1.0, 3.0]),
        trainer_restart_s=rng.uniform(1.0, 45.0),
    )
    if rng.random() < 0.3:  # an authorized run (swarm_auth): its clocks within its own limit
        skew = min(scenario.faults.max_clock_skew_s, AdmissionConfig().max_clock_skew_s / 2)
        faults = dataclasses.replace(scenario.faults, max_clock_skew_s=skew)
        scenario = dataclasses.replace(scenario, authorized=True, faults=faults)
    return scenario


@dataclass
class SwarmSearchOutcome:
    seed: int
    result: SwarmResult

    @property
    def violations(self) -> list[str]:
        return self.result.summary["violations"]

    @property
    def failed(self) -> bool:
        return bool(self.violations)

    def summary(self) -> dict:
        return self.result.summary

    def line(self) -> str:
        scenario, summary = self.result.scenario, self.result.summary
        text = (
            f"seed {self.seed}: {scenario.stages} stages x {scenario.workers_per_stage}, "
            f"{scenario.trainers} trainer(s){', authorized' if scenario.authorized else ''}, "
            f"{scenario.duration_s:.0f} s; {summary['worker_departures']} deaths, "
            f"{summary['trainer_crashes']} trainer crashes, "
            f"{summary['worker_joins']} joins, {summary['partitions']} partitions, {summary['silences']} silences, "
            f"{summary['slowdowns']} slowdowns; {summary['completed']} samples, "
            f"{summary['averaging_rounds']} rounds, {summary['agreed_stages']}/{summary['final_rounds']} stage(s) agreeing after a last round"
        )
        if self.failed:
            text += (
                f"\n  FAILED: {'; '.join(self.violations)}"
                f"\n  replay: agora-sim search --swarm --replay {self.seed}"
            )
        return text


def swarm_search_one(seed: int) -> SwarmSearchOutcome:
    return SwarmSearchOutcome(seed, run_swarm_scenario(random_swarm_scenario(seed), check=True))
