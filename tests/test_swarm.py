"""The whole system: a local swarm (`tools/swarm.py up`) against the centralized reference.

Every node is its own OS process on 127.0.0.1; the tests drive the same commands a user runs.
The swarm is authorized, as a public run is: an authorizer process admits every node and
places the workers (two per stage). A 3-stage version of examples/tiny.toml with 2 workers
per stage and averaging on trains on shards made from the standard library's sources with its
BPE tokenizer (learned from them); its per-sample losses (the trainer's --loss-log) are
compared by sample id with `tools/reference_train.py` on the same samples. The swarm through
departures, arrivals and a stage's outage: tests/test_swarm_churn.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from agora_devkit.swarm import (
    LEARNED_NATS,
    MARGIN_S,
    REFERENCE_S,
    RUN_S,
    SAMPLES,
    first_samples,
    reference_losses,
)
from agora_trainer.data.held_out import validation_samples
from agora_trainer.data.shards import open_shard_set
from agora_worker.model.export import read_model
from agora_worker.model.inference import WholeModel, held_out_loss

pytestmark = pytest.mark.slow


@pytest.mark.timeout(RUN_S + REFERENCE_S + MARGIN_S, func_only=True)
def test_the_swarm_trains_like_the_centralized_reference(tmp_path, swarm_config, swarm_shards, swarm_factory):
    swarm = swarm_factory(swarm_config, swarm_shards, SAMPLES, export=True)
    stages = range(swarm.run.model.n_stages)
    assert [len(names) for names in swarm.placed()] == [2] * len(stages)  # the authorizer spread them
    averaged: set[int] = set()

    def every_stage_averaged() -> bool:  # replicas (2 in a group) averaged their whole segment
        for stage in stages:
            for report in swarm.averaging_reports(stage):
                if report.get("group_size", 0) >= 2 and report.get("averaging_success") == 1.0:
                    averaged.add(stage)
        return averaged == set(stages)

    swarm.while_running(every_stage_averaged, what="a complete averaging round in every stage")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    losses = swarm.losses()
    order = first_samples(swarm_shards, swarm.run, SAMPLES)
    assert sorted(losses) == sorted(order), output  # every sample once, none lost
    ours = np.array([losses[i] for i in order])
    reference = tmp_path / "reference.safetensors"
    theirs = reference_losses(
        swarm_config, swarm_shards, SAMPLES, tmp_path / "reference.jsonl", export=reference, order=order
    )
    window = slice(SAMPLES // 2, SAMPLES)  # the second half: the same samples on both sides
    gap = ours[window].mean() / theirs[window].mean() - 1
    print(f"swarm {ours[window].mean():.4f} vs reference {theirs[window].mean():.4f}: {gap:+.2%}")
    # Measured: +2.5 % while samples came in shard order (runs of one file's code: hard for
    # both sides); shuffled by data.shuffle_seed, where the reference learns faster from varied
    # samples than two sparsely averaged replicas per stage do in 1024 samples, +6.1 % to +7.4 %
    # at four commits of 2026-12-01/02 (two runs each) and +8.0 % to +8.4 % on 2026-12-03's main
    # (four runs), all on one machine: the spread of one run is about a point, so the bound sits
    # two above the highest (issue 19 measures the loss ratio over longer runs: benchmarks/efficiency.py).
    assert abs(gap) <= 0.10
    assert ours[window].mean() < ours[:64].mean() - LEARNED_NATS  # it learned
    # The model came out (exported from the workers' last checkpoints) and scores on the
    # validation split, which no trainer had, about as well as the centralized reference's.
    assert "held-out loss:" in output and "bits/byte" in output, output
    exported = read_model(swarm.run_dir / "model.safetensors")
    assert exported.source == "checkpoints" and min(exported.steps) >= SAMPLES // 16 * 3 // 4, exported.steps
    samples = validation_samples(open_shard_set(swarm_shards, "validation"), swarm.run.model.seq_len, 64)
    swarm_loss, reference_loss = (
        held_out_loss(WholeModel(read_model(path).modules(), seq_len=swarm.run.model.seq_len), samples)
        for path in (swarm.run_dir / "model.safetensors", reference)
    )
    print(f"held-out loss: swarm {swarm_loss:.4f}, reference {reference_loss:.4f}")
    # The same bound as the training loss above, for the same reason: after 1024 shuffled
    # samples the swarm trails by about what it trails in training (measured +5.2 % in CI on
    # 2026-12-02, under 5 % in the run before; the main job's 4096 samples: +2 %).
    assert abs(swarm_loss / reference_loss - 1) <= 0.10
