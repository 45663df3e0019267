"""Averaging parts without a network: segments, flat parameter access, the reducer's sums."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from agora_core.contract import Method
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_worker.averaging import reducer
from agora_worker.averaging.allreduce import slice_bounds
from agora_worker.averaging.matchmaking import Group, Peer
from agora_worker.averaging.reducer import SliceReduction, chunk_bounds
from agora_worker.averaging.segments import FlatParameters, SegmentLayout
from agora_worker.averaging.sender import contribute


def test_segments_partition_the_vector_and_agree_across_replicas():
    sizes = [5000, 12, 30000, 7]
    a = SegmentLayout(sizes, segments=5, run_seed=1, stage=2, block=1000)
    b = SegmentLayout(sizes, segments=5, run_seed=1, stage=2, block=1000)
    covered = np.zeros(a.total, dtype=int)
    for segment in range(5):
        assert a.ranges(segment) == b.ranges(segment)
        for start, stop in a.ranges(segment):
            covered[start:stop] += 1
    assert (covered == 1).all()  # every weight in exactly one segment
    assert abs(a.length(0) - a.total / 5) <= 2 * 1000
    other = SegmentLayout(sizes, segments=5, run_seed=1, stage=3, block=1000)
    assert any(a.ranges(s) != other.ranges(s) for s in range(5))  # each stage its own order


def test_flat_parameters_read_and_add_across_tensor_boundaries():
    tensors = [torch.arange(6.0), torch.arange(10.0, 14.0).view(2, 2), torch.zeros(3)]
    flat = FlatParameters(tensors)
    ranges = [(4, 8), (9, 13)]  # crosses from the first tensor into the second, then the third
    assert flat.read(ranges).tolist() == [4.0, 5.0, 10.0, 11.0, 13.0, 0.0, 0.0, 0.0]
    # two pieces, given out of order; position 4 is in neither
    flat.add(ranges, [(5, np.full(3, 2.0, dtype=np.float32)), (0, np.ones(4, dtype=np.float32))])
    assert tensors[0].tolist() == [0.0, 1.0, 2.0, 3.0, 5.0, 6.0]
    assert tensors[1].view(-1).tolist() == [11.0, 12.0, 12.0, 13.0]  # position 4 (13) untouched
    assert tensors[2].tolist() == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="outside"):
        flat.add(ranges, [(7, np.ones(2, dtype=np.float32))])


def test_the_delta_rule_keeps_progress_made_during_the_round():
    theta = [torch.tensor([1.0, 2.0, 3.0])]
    flat = FlatParameters(theta)
    snapshot = flat.read([(0, 3)])  # theta* at the round's start
    theta[0] += torch.tensor([0.5, 0.0, -0.5])  # a training step during the round
    average = np.array([2.0, 2.0, 2.0], dtype=np.float32)
    flat.add([(0, 3)], [(0, average - snapshot)])
    assert theta[0].tolist() == [2.5, 2.0, 1.5]  # average + the local step


def group(*weights: float) -> Group:
    members = tuple(
        Peer(node_id=f"n{i}", address="", weight=w, reducer=True, phase="serving")
        for i, w in enumerate(weights)
    )
    return Group(1, members)


def slice_reduction(g: Group, *, stop: int, chunk: int, chunk_timeout_s: float, **kwargs) -> SliceReduction:
    """A reducer of slice 0, values [0, stop), with no round deadline."""
    return SliceReduction(
        group=g,
        slice_index=0,
        start=0,
        stop=stop,
        chunk=chunk,
        chunk_timeout_s=chunk_timeout_s,
        deadline=1e18,
        **kwargs,
    )


async def drain(reduction: SliceReduction, sender: str) -> dict[int, np.ndarray]:
    out = {}
    queue = reduction.outboxes[sender]
    while not queue.empty():
        item = queue.get_nowait()
        if item is None:
            break
        out[item[0]] = item[1]
    return out


async def test_reducer_returns_weighted_average_minus_each_senders_values():
    g = group(1.0, 3.0, 0.0)  # n2 is in weight sync: it receives the average, does not move it
    reduction = slice_reduction(g, stop=6, chunk=4, chunk_timeout_s=5.0)
    values = {
        "n0": np.full(6, 1.0, np.float32),
        "n1": np.full(6, 5.0, np.float32),
        "n2": np.full(6, 100.0, np.float32),
    }
    for index, (lo, hi) in enumerate(reduction.chunks):
        for sender, v in values.items():
            reduction.add(sender, index, v[lo:hi])
    assert reduction.finished and reduction.done.is_set()
    average = (1.0 * 1 + 3.0 * 5) / 4
    for sender, v in values.items():
        got = await drain(reduction, sender)
        delta = np.concatenate([got[i] for i in range(len(reduction.chunks))])
        np.testing.assert_allclose(v + delta, average)
    assert reduction.received == reduction.expected_inputs == 6


async def test_a_sender_past_its_chunk_deadline_is_banned_and_the_rest_averaged():
    reduction = slice_reduction(group(1.0, 1.0, 1.0), stop=4, chunk=4, chunk_timeout_s=0.0)
    reduction.add("n0", 0, np.zeros(4, np.float32))
    reduction.add("n1", 0, np.full(4, 2.0, np.float32))
    assert not reduction.finished
    reduction.check_deadlines()  # n2 never sent: banned, chunk averaged over n0 and n1
    assert reduction.banned == {"n2"} and reduction.finished
    assert (await drain(reduction, "n0"))[0].tolist() == [1.0] * 4
    assert reduction.received == 2 and reduction.expected_inputs == 3
    alone = slice_reduction(group(1.0), stop=4, chunk=4, chunk_timeout_s=1.0)
    with pytest.raises(ValueError):
        alone.add("n0", 0, np.zeros(3, np.float32))


def test_slices_and_chunks_tile_the_segment():
    assert slice_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(3, 10, 4) == [(3, 7), (7, 10)]


async def test_a_banned_sender_is_taken_out_of_chunks_it_already_sent():
    reduction = slice_reduction(group(1.0, 1.0, 2.0), stop=8, chunk=4, chunk_timeout_s=60.0)
    reduction.add("n2", 1, np.full(4, 50.0, np.float32))  # its second chunk, then it goes silent
    reduction.add("n0", 1, np.full(4, 1.0, np.float32))
    reduction.check_deadlines()  # well within the timeout: nobody is banned yet
    assert not reduction.banned and reduction.pending == [0, 1]
    reduction.ban("n2", "its stream broke")
    reduction.add("n1", 1, np.full(4, 3.0, np.float32))
    assert reduction.pending == [0]  # chunk 1 finished over n0 and n1, without n2's 50s
    assert (await drain(reduction, "n0"))[1].tolist() == [1.0] * 4  # average 2 minus n0's 1


async def test_a_slow_sender_that_keeps_sending_is_not_banned():
    now = [0.0]  # the reducer's clock, moved by hand
    reduction = slice_reduction(group(1.0, 1.0), stop=12, chunk=4, chunk_timeout_s=0.2, clock=lambda: now[0])
    for index in range(3):
        reduction.add("n0", index, np.zeros(4, np.float32))
    for index in range(3):  # n1 lags the fast sender by more than the timeout, chunk after chunk
        now[0] += 0.15
        reduction.check_deadlines()
        reduction.add("n1", index, np.ones(4, np.float32))
    assert not reduction.banned and reduction.finished
    assert now[0] > reduction.chunk_timeout_s  # the fast sender's chunks waited past the timeout


async def test_a_sender_silent_past_the_timeout_while_it_owes_chunks_is_banned():
    now = [0.0]
    reduction = slice_reduction(group(1.0, 1.0), stop=8, chunk=4, chunk_timeout_s=0.2, clock=lambda: now[0])
    reduction.add("n0", 0, np.zeros(4, np.float32))
    reduction.add("n1", 0, np.ones(4, np.float32))
    reduction.add("n0", 1, np.zeros(4, np.float32))
    now[0] += 0.19
    reduction.check_deadlines()
    assert not reduction.banned  # silent, but not yet for the timeout
    now[0] += 0.02
    reduction.check_deadlines()
    assert reduction.banned == {"n1"} and reduction.finished  # chunk 1 averaged without it


async def test_blocked_reduction_matches_the_weighted_mean_and_reuses_received_buffers(monkeypatch):
    monkeypatch.setattr(reducer, "BLOCK_VALUES", 3)  # blocks of 3 over chunks of 7: a short last block
    g = group(2.0, 1.0, 0.0, 5.0)
    reduction = slice_reduction(g, stop=14, chunk=7, chunk_timeout_s=5.0)
    rng = np.random.default_rng(4)
    values = {f"n{i}": rng.standard_normal(14).astype(np.float32) for i in range(4)}
    received = {}  # copies as a reducer gets them off the wire: its own buffers
    for index, (lo, hi) in enumerate(reduction.chunks):
        for sender, v in values.items():
            owned = sender != "n0"  # n0 is the reducer itself: its snapshot must stay untouched
            chunk = v[lo:hi].copy() if owned else v[lo:hi]
            received[(sender, index)] = chunk
            reduction.add(sender, index, chunk, owned=owned)
    weights = np.array([2.0, 1.0, 0.0, 5.0])
    mean = sum(w * values[f"n{i}"].astype(np.float64) for i, w in enumerate(weights)) / weights.sum()
    snapshot = values["n0"].copy()
    for sender, v in values.items():
        got = await drain(reduction, sender)
        for index, (lo, hi) in enumerate(reduction.chunks):
            np.testing.assert_allclose(v[lo:hi] + got[index], mean[lo:hi], rtol=0, atol=2e-6)
            # a received chunk carries its difference back in place; the reducer's own does not
            assert (got[index] is received[(sender, index)]) == (sender != "n0")
    np.testing.assert_array_equal(values["n0"], snapshot)


async def test_senders_without_samples_get_a_plain_mean():
    reduction = slice_reduction(group(0.0, 0.0), stop=4, chunk=4, chunk_timeout_s=5.0)
    reduction.add("n0", 0, np.zeros(4, np.float32))
    reduction.add("n1", 0, np.full(4, 4.0, np.float32))
    assert (await drain(reduction, "n0"))[0].tolist() == [2.0] * 4


async def test_a_reducer_returning_a_chunk_twice_or_out_of_range_is_not_trusted():
    """A misbehaving reducer: the peer keeps what arrived well-formed, drops the rest, runs on."""
    server, client = RpcServer(listen="127.0.0.1:0"), RpcClient()
    replies = [(0, 4), (0, 4), (7, 4), (1, 3)]  # chunk 0, chunk 0 again, a chunk that does not exist

    async def bad_reducer(stream):
        async for _ in stream:
            pass
        for index, length in replies:
            await stream.send({"chunk": index}, {"delta": np.ones(length, np.float32)})
        return Payload()

    async def echo(request):
        return Payload(request.meta)

    server.register(Method.AVERAGING_REDUCE, bad_reducer, stream=True)
    server.register("test.echo", echo)
    address = await server.start()
    try:
        result = await contribute(
            client=client,
            local=lambda: None,
            group=group(1.0, 1.0),
            me="n1",
            reducer_address=address,
            slice_index=0,
            values=np.zeros(8, np.float32),
            start=0,
            chunk=4,
            deadline=time.monotonic() + 10.0,
        )
        assert [start for start, _ in result.pieces] == [0] and result.returned == {0}
        assert not result.excluded
        async with asyncio.timeout(10):  # both ends still serve after the bad exchange
            assert (await client.call(address, "test.echo", {"still": "up"})).meta == {"still": "up"}
    finally:
        await client.close()
        await server.stop()
