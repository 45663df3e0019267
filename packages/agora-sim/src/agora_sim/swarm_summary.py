"""What a simulated swarm's run reports: throughput, utilization, averaging, churn, losses.

Samples and tokens per virtual second; each stage's utilization (compute time over virtual
time, the mean of the replicas there from start to end) and the bottleneck; optimizer steps;
averaging rounds, their success and time; worker and trainer churn, the faults played, and
an authorized run's credentials; samples completed, retried and lost.
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agora_sim.swarm import SwarmScenario, _Swarm


def swarm_summary(
    scenario: SwarmScenario, swarm: _Swarm, busy_before: list[float], elapsed_s: float, *, seq_len: int
) -> dict:
    """The figures of the measured stretch (``elapsed_s`` virtual seconds; ``busy_before``:
    each worker's compute seconds when it began)."""
    workers, trainers = swarm.workers, swarm.trainers
    utilization = []
    for stage in range(scenario.stages):
        # the replicas there from start to end (a joiner's or a dead worker's share is partial)
        whole = [i for i in swarm.live(stage) if i < len(busy_before)] or swarm.live(stage)
        busy = [
            (workers[i].runtime.compute_seconds - (busy_before[i] if i < len(busy_before) else 0.0))
            / elapsed_s
            for i in whole
        ]
        utilization.append(sum(busy) / len(busy))
    rounds = [r for w in workers for r in w.averager.reports]
    grouped = [r for r in rounds if r.group_size >= 2 and r.averaging_success > 0]
    completed = swarm.trainer_set.completed()  # the crashed incarnations' samples too
    return {
        "seed": scenario.seed,
        "workers": len(workers),
        "trainers": len(trainers),
        "dht_members": len(swarm.members) + len(workers) + len(trainers) + 1,  # with the seed
        "seed_sees_live": swarm.seed.table.live_count(),  # the membership as the seed holds it
        "worker_joins": swarm.disturbances.counts["joins"],
        "worker_departures": swarm.disturbances.counts["departures"],
        "worker_joins_failed": swarm.disturbances.counts["joins_failed"],
        "trainer_crashes": swarm.trainer_set.crashes,
        "trainer_restarts": swarm.trainer_set.restarts,
        "trainer_restarts_refused": swarm.trainer_set.refused,
        **{kind: swarm.disturbances.counts[kind] for kind in ("partitions", "silences", "slowdowns")},
        "joiners_ready": sum(
            1 for i, w in enumerate(workers) if i >= len(busy_before) and w.ready and i not in swarm.dead
        ),
        "samples_per_s": completed / elapsed_s,
        "tokens_per_s": completed * seq_len / elapsed_s,
        "stage_utilization": utilization,
        "bottleneck_stage": max(range(scenario.stages), key=lambda s: utilization[s]),
        "optimizer_steps": [w.optimizer.step for i, w in enumerate(workers) if i not in swarm.dead],
        "averaging_rounds": len(rounds),
        "averaging_success": sum(r.averaging_success for r in rounds) / len(rounds) if rounds else None,
        "averaging_round_s": sum(r.seconds for r in rounds) / len(rounds) if rounds else None,
        # rounds that averaged with someone (a lone replica's end when its window does)
        "averaging_group_round_s": statistics.median(r.seconds for r in grouped) if grouped else None,
        "averaging_allreduce_s": statistics.median(r.allreduce_s for r in grouped) if grouped else None,
        "completed": completed,
        "authorized": scenario.authorized,
        **swarm.nodes.summary(_up(swarm)),
        # every sample taken from the shards is completed, on its way, or waiting to run again
        "lost": sum(  # a trainer down at the end: its restart takes its samples up again
            t.counters.dispatched - t.counters.completed - t.counters.in_flight - t.counters.requeued
            for i, t in enumerate(trainers)
            if i not in swarm.trainer_set.down
        ),
        "retries": sum(t.counters.retries for t in trainers),
        "in_flight_at_end": sum(t.counters.in_flight for t in trainers),
        "requeued": sum(t.counters.requeued for t in trainers),
    }


def _up(swarm: _Swarm) -> list:
    """The workers and trainers whose process runs now."""
    workers = [swarm.workers[i] for i in swarm.live()]
    return workers + [t for i, t in enumerate(swarm.trainers) if i not in swarm.trainer_set.down]
