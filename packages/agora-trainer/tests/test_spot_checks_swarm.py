"""Spot checks in a trainer at work (in-process, real sockets and DHT): of three head replicas,
the one whose outputs are wrong is caught by the other two, kept from new microbatches and
accused in the DHT with its evidence; honest replicas that differ a little are never accused.

The stages are plain RPC servers on 127.0.0.1 that answer like a head and a tail
(``agora_devkit.trainer``), so no torch is imported here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agora_core.admission.accusations import accusations_key, parse_accusations
from agora_core.schema import TrainerProgress
from agora_devkit.processes import poll_until
from agora_devkit.trainer import StandInStage, StandInSwarm, stand_in_run
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer

K = 4  # the boundary width
RUN = stand_in_run("spot-checks", K)


def honest(spread: float, seed: int):
    """A head replica's output: a function of the tokens, off by relative ``spread`` (the
    replica's own local steps)."""
    rng = np.random.default_rng(seed)

    def boundary(tokens: np.ndarray) -> np.ndarray:
        true = np.stack([np.cos(tokens * (j + 1) / 7.0) for j in range(K)], axis=-1).astype(np.float32)
        off = rng.normal(size=true.shape).astype(np.float32)
        return true + off * (spread * np.linalg.norm(true) / np.linalg.norm(off))

    return boundary


LIES = {
    "zeros": lambda tokens: np.zeros((*tokens.shape, K), np.float32),
    "random": lambda tokens: np.random.default_rng().normal(size=(*tokens.shape, K)).astype(np.float32),
}


@pytest.mark.parametrize("lie", sorted(LIES))
async def test_a_head_replica_with_wrong_outputs_is_caught_kept_from_work_and_accused_in_the_dht(
    tmp_path, lie
):
    make_shards(tmp_path / "shards", shards=1, tokenizer=ByteTokenizer(), sources=[Path(__file__)])
    heads = [
        StandInStage(0, K, honest(0.05, 1)),
        StandInStage(0, K, honest(0.05, 2)),
        StandInStage(0, K, LIES[lie]),
    ]
    liar = heads[2].key.node_id
    async with StandInSwarm(RUN, K, heads) as swarm:
        trainer = swarm.trainer(tmp_path / "shards", lanes=2, max_samples=60, spot_check_fraction=1.0)
        await trainer.start()
        counters = await trainer.train()
        assert counters.completed == 60
        assert trainer.router.spot.accused.keys() == {liar}  # the honest pair never
        checks = trainer.router.checks
        assert checks.mismatches >= 3 and checks.made >= 60
        # every sample the liar served forward failed its check and went back to the queue:
        # the tail trained only on honest outputs
        assert trainer.abandoned == 0  # a sample whose head output failed went back and completed
        assert trainer.balancers[0].distrusted(liar)
        # its signed report vouches, per worker, for the samples it computed: once per stage
        report = TrainerProgress.from_value(trainer.report().to_value())
        tail = swarm.stages[-1].key.node_id
        assert report.receipts[tail] == 60 and sum(report.receipts.values()) == 2 * 60
        await trainer.publish_progress()
        found: list = []

        async def published() -> bool:
            found[:] = parse_accusations(await swarm.seed.get(accusations_key(RUN.name)))
            return bool(found)

        await poll_until(published, what="the trainer's accusations in the DHT")
    [record] = found
    assert record.accuser == trainer.key.node_id and record.stage is None
    [accusation] = record.accusations
    assert accusation.accused == liar and accusation.kind == "compute_output" and accusation.rounds >= 3
    for evidence in accusation.evidence:
        assert evidence.stage == 0 and evidence.agreed <= evidence.tolerance < evidence.measured
        assert evidence.measured > 0.5  # zeros stand 1 apart, random values more
