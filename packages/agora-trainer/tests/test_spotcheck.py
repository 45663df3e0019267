"""Spot checks on their own: the distance of two outputs, the tolerance a stage learns from its
closest pair of replicas, the third replica's verdict, and the accusation that follows."""

from __future__ import annotations

import numpy as np
import pytest

from agora_core.admission.accusations import AccuserRecord
from agora_core.errors import ConfigError
from agora_core.wire.dtypes import TaggedArray
from agora_trainer.spotcheck import SpotCheckConfig, SpotChecker, distance, settle

RNG = np.random.default_rng(7)
OUT = RNG.normal(size=(4, 16, 8)).astype(np.float32)  # (B, T, k): one boundary


def near(scale: float) -> np.ndarray:
    """An honest replica's output: ``OUT`` moved by relative ``scale``."""
    step = RNG.normal(size=OUT.shape).astype(np.float32)
    return OUT + step * (scale * np.linalg.norm(OUT) / np.linalg.norm(step))


def test_distance_is_relative_and_unusable_outputs_are_infinitely_far():
    assert distance(OUT, OUT) == 0.0
    assert distance(OUT, near(0.1)) == pytest.approx(0.1, rel=0.1)
    assert distance(OUT * 10, near(0.1) * 10) == pytest.approx(distance(OUT, near(0.1)), rel=0.2)
    assert distance(OUT, np.zeros_like(OUT)) == pytest.approx(1.0)
    assert distance(OUT, RNG.normal(size=OUT.shape).astype(np.float32)) > 1.3  # unrelated: about sqrt 2
    assert distance(OUT, -OUT) == pytest.approx(2.0)
    assert distance(OUT, OUT[:2]) == float("inf")
    bad = OUT.copy()
    bad[0, 0, 0] = np.nan
    assert distance(OUT, bad) == float("inf")
    # a bf16 boundary (tagged words) reads as its float32 values: the top halves of the bits
    words = (OUT.view(np.uint32) >> 16).astype(np.uint16)
    assert distance(OUT, TaggedArray("bfloat16", words)) < 0.01


def test_a_stage_learns_its_tolerance_from_its_closest_pair_and_a_liar_cannot_raise_it():
    spot = SpotChecker(SpotCheckConfig(pair_checks=4, tolerance_factor=2.0), 2, node_id="t")
    assert spot.tolerance(0, "forward") is None  # nothing measured yet: no verdicts
    for _ in range(3):
        spot.measured(0, "forward", "a", "b", 0.30)
    assert spot.tolerance(0, "forward") is None
    spot.measured(0, "forward", "b", "a", 0.10)  # either order is the same pair
    assert spot.tolerance(0, "forward") == pytest.approx(2.0 * 0.30)
    for _ in range(8):  # a liar near both honest replicas' pair keeps its own pairs' medians high
        spot.measured(0, "forward", "a", "liar", 0.9)
        spot.measured(0, "forward", "liar", "b", 0.9)
    assert spot.tolerance(0, "forward") == pytest.approx(0.6)
    # stages, and kinds of check, learn apart
    assert spot.tolerance(1, "forward") is None and spot.tolerance(0, "gradient") is None
    for _ in range(4):
        spot.measured(1, "forward", "c", "d", 0.0)
    assert spot.tolerance(1, "forward") == SpotCheckConfig().min_tolerance


def test_a_third_replica_settles_a_mismatch_only_when_exactly_one_pair_agrees():
    garbage = RNG.normal(size=OUT.shape).astype(np.float32)
    odd, pair, measured, agreed = settle({"a": near(0.05), "b": garbage, "c": near(0.05)}, 0.3)
    assert odd == "b" and pair == ("a", "c") and measured > 1.0 and agreed < 0.3
    assert settle({"a": OUT, "b": near(0.05), "c": near(0.05)}, 0.3) is None  # all agree
    far = {"a": OUT, "b": garbage, "c": np.zeros_like(OUT)}
    assert settle(far, 0.3) is None  # nobody agrees: nothing to tell
    with pytest.raises(ValueError):
        settle({"a": OUT, "b": OUT}, 0.3)


def test_a_replica_standing_apart_is_accused_after_the_configured_mismatches_with_its_evidence():
    spot = SpotChecker(SpotCheckConfig(accuse_after=2), 3, node_id="trainer-1")
    outputs = {"h1": near(0.05), "liar": np.zeros_like(OUT), "h2": near(0.05)}
    spot.measured(1, "gradient", "h1", "liar", 0.01)
    first = spot.settle(1, "forward", spot.next_serial(), outputs, 0.3)
    assert first is not None and first.odd == "liar" and first.agreeing == ("h1", "h2")
    assert first.evidence.stage == 1 and first.evidence.measured > first.evidence.tolerance
    assert not spot.failed(first) and spot.record() is None  # one is not enough
    second = spot.settle(1, "forward", spot.next_serial(), outputs, 0.3)
    assert spot.failed(second) and not spot.failed(second)  # accused once, then it stands
    assert spot.failures("liar") == 3 and list(spot.accused) == ["liar"]
    record = spot.record()
    parsed = AccuserRecord.from_value(record.to_value())  # what every DHT replica checks
    assert parsed.stage is None and parsed.accuser == "trainer-1"
    [accusation] = parsed.accusations
    assert accusation.accused == "liar" and accusation.kind == "compute_output" and accusation.rounds == 3
    assert [e.check for e in accusation.evidence] == [2, 2, 1]  # newest first
    # the liar's pairs, of every kind of check, are no measure of honest divergence any more
    assert all(
        "liar" not in pair for kind in ("forward", "gradient") for pair in spot._tolerance[1, kind].pairs
    )


def test_no_accusation_with_accuse_after_0_and_config_errors_name_the_key():
    spot = SpotChecker(SpotCheckConfig(accuse_after=0), 1, node_id="t")
    mismatch = spot.settle(0, "gradient", 1, {"a": OUT, "b": -OUT, "c": OUT}, 0.3)
    assert mismatch.odd == "b" and not spot.failed(mismatch) and spot.record() is None
    with pytest.raises(ConfigError, match="fraction"):
        SpotCheckConfig(fraction=1.5)
    with pytest.raises(ConfigError, match="tolerance_factor"):
        SpotCheckConfig(tolerance_factor=0.5)


def test_a_fraction_of_hops_is_checked_a_third_as_many_for_gradients_and_0_checks_none():
    spot = SpotChecker(SpotCheckConfig(fraction=0.3), 1, node_id="t", seed=3)
    forward = sum(spot.due("forward") for _ in range(4000))
    gradient = sum(spot.due("gradient") for _ in range(4000))
    assert 1000 < forward < 1400 and 300 < gradient < 500
    never = SpotChecker(SpotCheckConfig(fraction=0.0), 1, node_id="t")
    assert not any(never.due("forward") or never.due("gradient") for _ in range(100))


def test_answers_of_several_outputs_stand_as_far_apart_as_their_farthest_output():
    loss = np.array([3.0, 3.1], np.float32)
    assert distance({"loss": loss, "grad": OUT}, {"loss": loss, "grad": near(0.1)}) == pytest.approx(
        0.1, rel=0.2
    )
    assert distance({"loss": loss, "grad": OUT}, {"loss": loss * 2, "grad": OUT}) == pytest.approx(0.5)
    assert distance({"loss": loss}, {"grad": OUT}) == float("inf")  # not the same question
