"""Placement picks the stage with the least capacity for its demand."""

from __future__ import annotations

from agora_authorizer.placement import StageLoad, choose_stage


def test_counts_per_layer_decide_until_every_stage_has_a_measured_rate():
    loads = [
        StageLoad(stage=0, layers=1, announced={"a": 0.0}),
        StageLoad(stage=1, layers=2, announced={"b": 0.0}),
    ]
    assert choose_stage(loads) == 1  # one worker for two layers is the thinner stage
    loads[1].promised.add("c")
    assert choose_stage(loads) == 0  # one per layer on both: the tie goes to the lower stage
    assert (
        choose_stage([StageLoad(stage=0, layers=1), StageLoad(stage=1, layers=1)]) == 0
    )  # ties: lower stage


def test_measured_rates_put_the_newcomer_on_the_slowest_stage():
    fast = StageLoad(stage=0, layers=1, announced={"a": 10.0, "b": 10.0})
    slow = StageLoad(stage=1, layers=1, announced={"c": 3.0, "d": 3.0, "e": 3.0})
    assert choose_stage([fast, slow]) == 1  # 9 samples/s against 20, though it has more workers
    slow.promised |= {"f", "g", "h", "i"}  # promised workers count at the stage's mean rate
    assert choose_stage([fast, slow]) == 0
    # a promised node that already announced counts once
    slow.promised = {"c"}
    assert slow.workers == 3
