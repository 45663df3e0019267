"""Churn judged by the model, not only by the samples: a swarm of 3 replicas a stage loses a
worker and gains one every ~12 s, on every stage in turn, head and tail included, and trains
as well as a calm one.

It runs ``benchmarks/join_churn.py`` for one seed (the benchmark drives ``tools/swarm.py up``,
``kill-worker`` and ``add-worker`` as an operator would, from the 512th sample on, then a calm
run of the same swarm) and holds its figures to the bounds: no sample lost or done twice, no 64-sample window after
the first 512 above 1.5x the one before it, the exported model's held-out loss within 5 % of
the calm run's. The benchmark runs the same over ten seeds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agora_devkit.swarm import ROOT

pytestmark = pytest.mark.slow

SAMPLES = 6144  # the fourth stage's newcomer serves well before the end on a busy machine
RUN_S = 1200  # both runs, start to finish, on a busy two-core machine


@pytest.mark.timeout(RUN_S + 60, func_only=True)
def test_a_swarm_that_loses_and_gains_workers_on_every_stage_learns_as_a_calm_one(swarm_shards, tmp_path):
    command = [sys.executable, str(ROOT / "benchmarks" / "join_churn.py"), "--json", "--seeds", "1"]
    command += ["--samples", str(SAMPLES), "--shards", str(swarm_shards), "--work-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_S, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = {f["name"]: f for f in json.loads(done.stdout.strip().splitlines()[-1])["figures"]}
    value = lambda name: figures[name]["value"]  # noqa: E731
    context = json.dumps(figures, indent=1)
    stages = int(value("stages"))
    assert value("seed 0 stages joined") == stages, context  # a newcomer served on every stage
    assert value("worst samples lost") == 0 and value("worst samples completed twice") == 0, context
    assert value("worst window") <= 1.5, context
    assert value("worst held-out vs calm") <= 1.05, context
    # No step took in what many batches' worth of samples (a flooded joiner once took 228 of 16).
    assert value("largest step") <= 4 * value("target batch"), context
