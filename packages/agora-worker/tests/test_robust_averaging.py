"""Robust averaging: a lying sender, reducer or weight moves an honest peer a bounded distance."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from agora_core.rpc import RpcClient, RpcServer
from agora_worker.averaging.board import ReductionBoard
from agora_worker.averaging.matchmaking import Group, Peer
from agora_worker.averaging.reducer import SliceReduction
from agora_worker.averaging.robust import (
    MIN_HISTORY_ROUNDS,
    DriftHistory,
    Returned,
    bound_returned,
    weight_cap,
)
from agora_worker.averaging.sender import contribute

N = 4096  # values in the slice
CHUNK = 1024
DRIFT = 0.01  # per-value honest distance between replicas


def group(*weights: float) -> Group:
    members = tuple(
        Peer(node_id=f"n{i}", address="", weight=w, reducer=True, phase="serving")
        for i, w in enumerate(weights)
    )
    return Group(7, members)


BLOCKS = [(0, i) for i in range(N // CHUNK)]  # the history keys of segment 0's chunks


def history(*rounds: float, multiplier: float = 4.0) -> DriftHistory:
    """A drift history whose every block of segment 0 saw ``rounds``."""
    drift = DriftHistory(multiplier=multiplier, rounds=16)
    for rms in rounds:
        for key in BLOCKS:
            drift.observe(key, rms)
        drift.close_round()
    return drift


def reduce(g: Group, values: dict[str, np.ndarray], *, drift: DriftHistory, cap: float = math.inf):
    """n0 reduces the whole slice; each sender's new values (its own + its difference)."""
    reduction = SliceReduction(
        group=g,
        slice_index=0,
        start=0,
        stop=N,
        chunk=CHUNK,
        chunk_timeout_s=5.0,
        deadline=1e18,
        me="n0",
        drift=drift,
        weight_cap=cap,
    )
    for index, (lo, hi) in enumerate(reduction.chunks):
        for sender, v in values.items():
            reduction.add(sender, index, v[lo:hi].copy(), owned=sender != "n0")
    assert reduction.finished
    moved = {}
    for sender, v in values.items():
        queue, new = reduction.outboxes[sender], v.copy()
        while (item := queue.get_nowait()) is not None:
            lo, hi = reduction.chunks[item[0]]
            new[lo:hi] += item[1]
        moved[sender] = new
    return reduction, moved


def replicas(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.normal(0.0, 0.1, N).astype(np.float32)
    return [base + rng.normal(0.0, DRIFT, N).astype(np.float32) for _ in range(count)]


def rms(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2)))


def test_the_radius_needs_history_or_two_other_peers():
    block = BLOCKS[0]
    assert history().radius(block, [0.5]) == math.inf  # one other peer, no history: it may be the liar
    assert history().radius(block, [0.01, 5.0]) == pytest.approx(0.04)  # lower median: the honest one
    short = history(*[0.01] * (MIN_HISTORY_ROUNDS - 1))
    assert short.radius(block, [9.0]) == math.inf
    known = history(*[0.01] * MIN_HISTORY_ROUNDS)
    assert known.radius(block, [9.0]) == pytest.approx(0.04)
    assert known.radius((1, 0), [9.0]) == math.inf  # another block's past says nothing of this one
    # two or more others: this round's lower median, whatever the history (drift changes)
    assert known.radius(block, [0.5, 0.5, 9.0]) == pytest.approx(2.0)
    assert history().radius(block, [0.0, 0.0, 9.0]) == 0.0  # identical honest copies: only they count
    assert history(0.01, 0.01, 0.01, multiplier=0).radius(block, [0.01, 0.01]) == math.inf  # off


def test_only_distances_inside_the_radius_are_remembered():
    drift = history(*[0.01] * MIN_HISTORY_ROUNDS)
    own, other = replicas(2)
    for _ in range(2 * MIN_HISTORY_ROUNDS):  # a pair whose other peer lies every round
        reduce(group(1.0, 1.0), {"n0": own, "n1": other * 50}, drift=drift)
        drift.close_round()
    assert drift.radius(BLOCKS[0]) == pytest.approx(0.04)  # the liar never widened it


def test_a_scaled_sender_is_clipped_around_the_reducers_own_values():
    own, honest, base = *replicas(2), replicas(1, seed=1)[0]
    liar = base * 3.0  # finite, plausible-looking, far off
    reduction, moved = reduce(group(1.0, 1.0, 1.0), {"n0": own, "n1": honest, "n2": liar}, drift=history())
    radius = 4.0 * rms(own, honest)  # the lower median of the others' distances, times 4
    assert rms(moved["n0"], own) <= radius / 3 * 2 + 1e-6  # two clipped-or-honest shares of 1/3
    assert {c.peer for c in reduction.clipped} == {"n2"}  # the honest sender is never clipped
    assert all(c.role == "sender" and c.rms > c.radius for c in reduction.clipped)
    assert len(reduction.clipped) == len(reduction.chunks)  # one record per chunk: the evidence
    plain, _ = reduce(
        group(1.0, 1.0, 1.0), {"n0": own, "n1": honest, "n2": liar}, drift=history(multiplier=0)
    )
    assert not plain.clipped  # clipping off: the plain weighted mean takes the liar in


def test_a_group_of_two_is_protected_by_its_history():
    own, other = replicas(2)
    liar = other * -1.0  # sign flip
    drift = history(*[DRIFT * math.sqrt(2)] * MIN_HISTORY_ROUNDS)
    reduction, moved = reduce(group(1.0, 1.0), {"n0": own, "n1": liar}, drift=drift)
    assert rms(moved["n0"], own) <= 4.0 * DRIFT * math.sqrt(2) / 2 + 1e-6
    assert {c.peer for c in reduction.clipped} == {"n1"}
    # an honest peer, same history: nothing clipped, its distance recorded for the next round
    reduction, moved = reduce(group(1.0, 1.0), {"n0": own, "n1": other}, drift=drift)
    assert not reduction.clipped
    np.testing.assert_allclose(moved["n0"], (own + other) / 2, atol=1e-6)


def test_a_non_finite_sender_counts_for_nothing():
    own, honest = replicas(2)
    poison = honest.copy()
    poison[5] = np.nan
    reduction, moved = reduce(group(1.0, 1.0, 1.0), {"n0": own, "n1": honest, "n2": poison}, drift=history())
    assert np.isfinite(moved["n0"]).all() and np.isfinite(moved["n1"]).all()
    assert [c.chunk for c in reduction.clipped if c.peer == "n2"] == [0]  # only the chunk with the NaN
    lo, hi = reduction.chunks[0]
    np.testing.assert_allclose(moved["n0"][lo:hi], ((2 * own + honest) / 3)[lo:hi], atol=1e-6)


def test_a_declared_weight_counts_only_up_to_the_cap():
    own, other = replicas(2)
    reduction, moved = reduce(group(10.0, 1e9), {"n0": own, "n1": other}, drift=history(), cap=40.0)
    np.testing.assert_allclose(moved["n0"], (10 * own + 40 * other) / 50, atol=1e-6)
    assert [(c.peer, c.role, c.rms, c.radius) for c in reduction.clipped] == [("n1", "weight", 1e9, 40.0)]
    stage = {"members": 4, "cadence_steps": 10, "target_batch_size": 8}  # 80 samples a round
    assert weight_cap(own=30, ratio=4, **stage) == 120  # 4x its own
    assert weight_cap(own=0, ratio=4, **stage) == 80  # 4x a fair share (a quarter of a round)
    assert weight_cap(own=1e6, ratio=4, **stage) == 160  # never above two rounds' samples
    assert weight_cap(own=1, ratio=0, **stage) == 160


def returned(reducer: str, slice_index: int, *differences: np.ndarray, first: int = 0) -> Returned:
    """A reducer's pieces: chunks ``first``... of segment 0, one per difference."""
    pieces = [((first + i) * CHUNK, d) for i, d in enumerate(differences)]
    return Returned(slice=slice_index, reducer=reducer, pieces=pieces, chunks=list(range(len(differences))))


def bound(returns: list[Returned], drift: DriftHistory):
    return bound_returned(returns, me="n0", drift=drift, round_index=7, segment=0, block=CHUNK)


def test_a_sender_bounds_what_a_lying_reducer_returns():
    """Each block's differences are held against that block's past: a lying reducer's count at
    most the radius (4x the typical), NaN not at all; an honest one's and its own are taken."""
    typical = 0.01
    honest = np.full(CHUNK, typical, np.float32)
    drift = history(*[typical] * MIN_HISTORY_ROUNDS)
    mine, other = returned("n0", 0, honest.copy() * 50), returned("n1", 1, honest.copy(), first=1)
    liar = returned(
        "n2", 2, np.full(CHUNK, 100 * typical, np.float32), np.full(CHUNK, np.nan, np.float32), first=2
    )
    evidence = bound([mine, other, liar], drift)
    assert [(c.chunk, c.peer, c.role, c.round) for c in evidence] == [
        (0, "n2", "reducer", 7),
        (1, "n2", "reducer", 7),
    ]
    assert len(liar.pieces) == 1 and liar.chunks == [0]  # the NaN chunk is dropped: local values stay
    assert float(np.sqrt(np.mean(liar.pieces[0][1] ** 2))) == pytest.approx(4 * typical, rel=1e-5)
    np.testing.assert_array_equal(other.pieces[0][1], honest)
    np.testing.assert_array_equal(mine.pieces[0][1], honest * 50)  # its own reduction: never bounded


def test_a_block_seen_too_rarely_is_taken_as_it_comes():
    lie = np.full(CHUNK, 1.0, np.float32)
    fresh = returned("n1", 0, lie.copy())
    assert not bound([fresh], history(0.01))  # one visit: nothing to hold it against yet
    np.testing.assert_array_equal(fresh.pieces[0][1], lie)


@pytest.mark.parametrize(("caller", "admitted"), [("n1", True), ("n9", False)])
async def test_a_stream_sends_only_as_its_caller(caller, admitted):
    """A reducer takes a sender's chunks only from that sender's own connection (its node id
    is authenticated in an authorized run): nobody contributes in another peer's name."""
    server = RpcServer(listen="127.0.0.1:0")
    board = ReductionBoard(server, early_wait_s=1.0, stage=0)
    client = RpcClient(node_id=caller)
    g = group(1.0, 1.0)
    reduction = SliceReduction(
        group=g, slice_index=0, start=0, stop=CHUNK, chunk=CHUNK, chunk_timeout_s=5.0, deadline=1e18, me="n0"
    )
    board.open([reduction], g.round)
    reduction.add("n0", 0, np.zeros(CHUNK, np.float32))
    address = await server.start()
    try:
        result = await contribute(
            client=client,
            local=lambda: None,
            group=g,
            me="n1",
            reducer_address=address,
            slice_index=0,
            values=np.ones(CHUNK, np.float32),
            start=0,
            chunk=CHUNK,
            deadline=time.monotonic() + 10.0,
        )
    finally:
        await client.close()
        await server.stop()
    assert result.excluded is not admitted
    assert reduction.heard_from == ({"n0", "n1"} if admitted else {"n0"})
