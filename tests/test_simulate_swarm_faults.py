"""Faults in simulated swarms, the invariants checked once they settle, and the swarm search."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agora_sim.scenario import ScenarioError
from agora_sim.swarm import SwarmScenario, parse_swarm, run_swarm_scenario
from agora_sim.swarm_faults import SwarmFaults
from agora_sim.swarm_search import random_swarm_scenario, swarm_search_one
from agora_worker.averaging.averager import Averager

ROOT = Path(__file__).resolve().parents[1]


FAULTY = SwarmScenario(
    seed=13,
    duration_s=40.0,
    stages=2,
    workers_per_stage=3,
    lanes=3,
    target_batch_size=8,
    averaging_every_steps=2,
    matchmaking_s=3.0,
    speed=(0.5, 2.0),
    worker_departures_per_min=4.0,
    worker_joins_per_min=4.0,
    faults=SwarmFaults(
        partitions_per_min=3.0,
        partition_s=4.0,
        silences_per_min=4.0,
        silence_s=3.0,
        max_clock_skew_s=10.0,
        slowdowns_per_min=4.0,
        slowdown_factor=5.0,
        slowdown_s=5.0,
    ),
)


def test_a_swarm_through_every_kind_of_fault_settles_with_nothing_lost_and_replicas_agreeing():
    summary = run_swarm_scenario(FAULTY, check=True).summary
    assert summary["violations"] == []
    for kind in ("partitions", "silences", "slowdowns", "worker_departures", "worker_joins"):
        assert summary[kind] > 0, kind  # each fault happened, or the test checks less than it says
    assert summary["completed"] > 50 and summary["lost"] == 0 and summary["completed_twice"] == 0
    assert summary["agreed_stages"] >= 1  # a stage with two replicas left was checked


def test_replicas_that_drop_the_average_are_caught_by_the_agreement_check(monkeypatch):
    # the delta rule skipped: every replica keeps its own weights after a "clean" round
    monkeypatch.setattr(
        Averager, "_apply", lambda self, ranges, pieces, snapshot: (self._optimizer.step, 0.0)
    )
    calm = SwarmScenario(
        **{**FAULTY.__dict__, "faults": SwarmFaults(), "duration_s": 6.0, "workers_per_stage": 2}
        | {"worker_departures_per_min": 0.0, "worker_joins_per_min": 0.0}
    )
    summary = run_swarm_scenario(calm, check=True).summary
    assert any("replicas differ" in v for v in summary["violations"]), summary["violations"]


def test_a_swarm_search_seed_replays_to_the_same_trace():
    first, second = swarm_search_one(4), swarm_search_one(4)
    assert first.result.summary["digest_settled"] == second.result.summary["digest_settled"]
    assert first.result.summary["completed"] == second.result.summary["completed"]
    assert not first.failed, first.line()
    assert random_swarm_scenario(4) == first.result.scenario != random_swarm_scenario(5)


def test_the_swarm_search_command_reports_its_seeds(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "simulate.py"), "search", "--swarm", "--seeds", "1", "--start", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["seeds"] == 1 and report["failed"] == [] and report["totals"]["completed"] > 0


def test_a_faults_table_is_checked():
    with pytest.raises(ScenarioError, match="unknown keys: floods_per_min"):
        parse_swarm({"faults": {"floods_per_min": 1.0}})
    with pytest.raises(ScenarioError, match="slowdown_factor"):
        parse_swarm({"faults": {"slowdown_factor": 0.5}})
    with pytest.raises(ScenarioError, match="max_clock_skew_s"):
        parse_swarm({"faults": {"max_clock_skew_s": 300.0}})
    assert parse_swarm({"faults": {"slowdowns_per_min": 2}}).faults.slowdowns_per_min == 2.0
