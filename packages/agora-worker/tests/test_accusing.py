"""From clipped contributions to accusations (agora_worker.averaging.accusing), on exact rounds."""

from __future__ import annotations

from agora_core.admission.accusations import AccuserRecord
from agora_worker.averaging.accusing import FLOAT32_MAX, Accuser
from agora_worker.averaging.robust import Clipped

ME, LIAR, HONEST = "m" * 40, "l" * 40, "h" * 40


def accuser(after: int = 3, window: int = 8) -> Accuser:
    return Accuser(node_id=ME, stage=1, after_rounds=after, window_rounds=window, weight_limit=1000.0)


def clip(
    round_index: int, peer: str = LIAR, role: str = "sender", rms: float = 5.0, radius: float = 1.0
) -> Clipped:
    return Clipped(round=round_index, slice=0, chunk=2, peer=peer, role=role, rms=rms, radius=radius)


def test_a_peer_clipped_in_enough_rounds_of_the_window_is_accused_once():
    a = accuser()
    assert a.observe(0, [clip(0), clip(0, rms=9.0)]) == []  # two clips of one round count once
    assert a.observe(1, []) == []
    assert a.observe(2, [clip(2)]) == []
    assert a.observe(3, [clip(3, role="reducer")]) == []  # another kind counts apart
    assert a.observe(4, [clip(4)]) == [(LIAR, "averaging_values")]
    assert a.observe(5, [clip(5)]) == []  # already accused
    (accusation,) = a.record().accusations
    assert (accusation.accused, accusation.kind, accusation.rounds) == (LIAR, "averaging_values", 4)
    assert [e.round for e in accusation.evidence] == [5, 4, 2, 0]  # newest first
    assert accusation.evidence[-1].measured == 9.0  # a round's worst clip
    assert a.info() == {LIAR: ["averaging_values"]}


def test_clips_spread_wider_than_the_window_never_add_up():
    a = accuser(after=3, window=4)
    for round_index in range(40):
        clipped = [clip(round_index, peer=HONEST)] if round_index % 3 == 0 else []
        assert a.observe(round_index, clipped) == []  # at most 2 clipped rounds in any 4
    assert a.record() is None
    assert len(a._seen) <= 1 and all(len(s.rounds) <= 2 for s in a._seen.values())  # forgotten


def test_a_weight_is_accused_only_past_what_no_honest_peer_declares():
    a = accuser(after=1, window=1)
    assert a.observe(0, [clip(0, role="weight", rms=999.0, radius=8.0)]) == []  # a fast honest peer
    assert a.observe(1, [clip(1, role="weight", rms=1e9, radius=8.0)]) == [(LIAR, "averaging_weight")]


def test_zero_rounds_never_accuses_and_itself_is_never_accused():
    never = accuser(after=0)
    for round_index in range(10):
        assert never.observe(round_index, [clip(round_index)]) == []
    assert never.record() is None
    a = accuser(after=1, window=1)
    assert a.observe(0, [clip(0, peer=ME)]) == []
    assert a.record() is None


def test_non_finite_evidence_is_accused_and_its_record_still_valid():
    """A peer that sent NaN or infinite values (or declared an infinite weight) leaves a
    non-finite distance: the record holds it as the largest float32, so replicas take it."""
    a = accuser(after=1, window=1)
    nan, inf = float("nan"), float("inf")
    assert a.observe(0, [clip(0, rms=nan), clip(0, peer=HONEST, role="weight", rms=inf)]) == [
        (LIAR, "averaging_values"),
        (HONEST, "averaging_weight"),
    ]
    value = a.record().to_value()
    parsed = AccuserRecord.from_value(value)  # raises on a non-finite number
    assert sorted(e.measured for acc in parsed.accusations for e in acc.evidence) == [FLOAT32_MAX] * 2
