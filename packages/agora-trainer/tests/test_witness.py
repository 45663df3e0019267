"""The loss witness: a replica whose samples fare far worse than its stage peers' over the same
period is an outlier; equal replicas, a falling loss, too few samples and blame that belongs
to another stage's replica give no verdict; memory stays bounded whatever node ids appear."""

from __future__ import annotations

import random

import numpy as np
import pytest

from agora_core.errors import ConfigError
from agora_trainer.settings import TrainerSettings
from agora_trainer.witness import LossWitness, WitnessConfig


def noisy(rng: random.Random, mean: float, relative_sd: float = 0.3) -> float:
    return max(0.05, rng.gauss(mean, relative_sd * mean))


def test_the_one_replica_of_three_whose_samples_fare_twice_as_badly_is_the_outlier():
    rng = random.Random(1)
    witness = LossWitness(2)  # a lone head, three tail replicas
    verdicts = []
    for i in range(200):
        tail = "abc"[i % 3]
        loss = noisy(rng, 8.0 if tail == "c" else 4.0)
        verdicts += witness.record(["head", tail], [loss])
        if verdicts:
            break
    assert [(v.stage, v.node_id) for v in verdicts] == [(1, "c")]
    (v,) = verdicts
    assert i < 60  # as soon as it and its peers have min_samples each (16 of c: 48 samples)
    assert v.samples >= 16 and v.others_samples >= 16
    assert v.mean_loss == pytest.approx(8.0, rel=0.2) and v.others_mean_loss == pytest.approx(4.0, rel=0.2)
    assert witness.samples(1, "c") == 0  # forgotten: judged afresh on new samples
    assert witness.samples(0, "head") < i + 1  # its samples through c are no evidence either
    assert witness.samples(1, "a") > 0


def test_equal_replicas_are_never_outliers_however_noisy_their_samples():
    rng = random.Random(2)
    witness = LossWitness(3)
    replicas = [["h0", "h1", "h2"], ["m0", "m1"], ["t0", "t1", "t2"]]
    shares = [[0.6, 0.3, 0.1], [0.5, 0.5], [0.45, 0.45, 0.1]]  # a slow replica serves fewer
    verdicts = []
    for i in range(20000):
        served = [rng.choices(names, weights)[0] for names, weights in zip(replicas, shares, strict=True)]
        level = 2.5 + 8.0 * np.exp(-i / 3000)  # the loss falls over the run
        losses = [noisy(rng, level) for _ in range(rng.choice((1, 2, 4)))]
        verdicts += witness.record(served, losses)
    assert verdicts == []


def test_a_replica_that_served_only_early_samples_of_a_falling_loss_is_not_an_outlier():
    witness = LossWitness(1)
    config = witness.config
    mine, others = [], []
    for i in range(500):
        level = 3.0 + 9.0 * np.exp(-i / 120)  # falls steeply
        if i < 60:
            node = "abc"[i % 3]  # a serves in the first two periods only ...
        else:
            node = "bc"[i % 2]  # ... then sits out (banned, syncing) while the loss falls
        (mine if node == "a" else others).append((i, level))
        assert witness.record([node], [level]) == []
    level = 3.0 + 9.0 * np.exp(-500 / 120)
    assert witness.record(["a"], [level]) == []  # ... and comes back: no worse than its peers
    # A comparison of plain means over the window would have condemned it.
    window = 500 - config.period_samples * config.window_periods
    mean_a = np.mean([loss for _, loss in mine] + [level])
    mean_others = np.mean([loss for i, loss in others if i > window])
    assert mean_a > config.ratio * mean_others


def test_too_few_samples_on_either_side_give_no_verdict():
    witness = LossWitness(2, WitnessConfig(min_samples=16))
    for _ in range(15):  # 15 samples of c, 10x its peers'
        for tail, loss in (("a", 4.0), ("b", 4.0), ("c", 40.0)):
            found = witness.record(["head", tail], [loss])
            assert found == [], found
    assert [(v.node_id, v.samples) for v in witness.record(["head", "c"], [40.0])] == [("c", 16)]

    peers_short = LossWitness(2, WitnessConfig(min_samples=16))
    for i in range(40):  # plenty of c, but its only peer served 15 samples
        tail = "a" if i % 2 and i < 30 else "c"
        assert peers_short.record(["head", tail], [4.0 if tail == "a" else 40.0]) == []

    alone = LossWitness(2)
    rng = random.Random(3)
    for _ in range(1000):  # one replica per stage: nothing to compare, whatever its losses
        assert alone.record(["head", "tail"], [rng.uniform(1.0, 100.0)]) == []


def test_a_nan_loss_counts_as_infinitely_bad():
    witness = LossWitness(1, WitnessConfig(min_samples=2))
    witness.record(["a"], [4.0, 4.0])
    witness.record(["b"], [4.0, 4.0])
    (v,) = witness.record(["c"], [float("nan"), float("inf")])
    assert v.node_id == "c" and v.mean_loss == float("inf")


def test_a_head_replica_routed_with_a_wrecked_tail_replica_more_often_is_not_blamed():
    rng = random.Random(4)
    witness = LossWitness(2)
    verdicts, excluded = [], set()
    for i in range(400):
        head = "xy"[i % 2]
        tail = rng.choices("ab", (3, 1) if head == "x" else (1, 3))[0]  # x meets a 3 times in 4
        if (0, head) in excluded:  # routing sends nothing more to a condemned replica
            head = "y" if head == "x" else "x"
        if (1, tail) in excluded:
            tail = "b" if tail == "a" else "a"
        found = witness.record([head, tail], [noisy(rng, 40.0 if tail == "a" else 4.0, 0.1)])
        excluded |= {(v.stage, v.node_id) for v in found}
        verdicts += found
    assert [(v.stage, v.node_id) for v in verdicts] == [(1, "a")]


def test_when_routes_are_fully_paired_one_of_the_pair_is_the_outlier_not_both():
    witness = LossWitness(2)
    verdicts = []
    for i in range(200):
        head, tail = ("x", "a") if i % 2 else ("y", "b")  # x always meets a: nothing tells them apart
        verdicts = witness.record([head, tail], [40.0 if tail == "a" else 4.0])
        if verdicts:
            break
    assert len(verdicts) == 1 and verdicts[0].node_id in ("x", "a")
    # Every sample through the one condemned is forgotten, so the other is not condemned on them.
    assert witness.samples(0, "x") == witness.samples(1, "a") == 0


def test_memory_stays_bounded_whatever_node_ids_come_and_go():
    config = WitnessConfig(period_samples=8, window_periods=4)
    witness = LossWitness(2, config)
    window = config.period_samples * config.window_periods
    for i in range(10000):
        witness.record([f"h{i}", f"t{i % 7919}"], [4.0, 4.0])  # a new head every microbatch
    assert len(witness.node_ids(0)) <= window and len(witness.node_ids(1)) <= window
    assert witness.samples(0, "h0") == 0 and witness.samples(0, "h9999") == 2
    assert sum(witness.samples(0, n) for n in witness.node_ids(0)) <= window + 2


def test_nonsense_is_refused_naming_what():
    with pytest.raises(ValueError, match="2 stages, not 1"):
        LossWitness(2).record(["a"], [1.0])
    with pytest.raises(ValueError, match="at least one sample"):
        LossWitness(1).record(["a"], [])
    with pytest.raises(ConfigError, match="ratio"):
        WitnessConfig(ratio=1.0)
    with pytest.raises(ConfigError, match="loss_outlier_ratio"):
        TrainerSettings(loss_outlier_ratio=0.5)
    with pytest.raises(ConfigError, match="distrust_s"):
        TrainerSettings(distrust_s=0)
