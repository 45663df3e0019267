"""Butterfly all-reduce of one segment: a reduce-scatter and an all-gather, in one pass.

The segment is cut into one contiguous slice per reducer. Every peer streams its copy of each
slice to that slice's reducer in fixed-size chunks; the reducer queues each chunk as it
arrives and, once a chunk has come in from every live sender, takes their weighted average
and streams back to each sender the *difference* between the average and that sender's
chunk, while the next chunks are still on their way. Sending and reducing overlap: one
stream per (sender, slice) carries chunks one way and differences the other. A sender that
misses a chunk's deadline is banned for the round and the chunk is averaged over the others;
a difference that never comes back leaves the local values alone. Reducers clip, senders
bound, and declared weights are capped (:mod:`.robust`, with :class:`RoundGuard`'s state).

This module runs one round; the pieces live beside it: :mod:`.reducer` (a reducer's state for
one slice and the averaging kernel), :mod:`.sender` (a peer's stream of one slice to its
reducer) and :mod:`.board` (the reducer's side of those streams, registered on the RPC server).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from agora_core import world
from agora_core.injection import NO_INJECTIONS, InjectionPoints
from agora_core.rpc import RpcClient
from agora_worker.averaging.board import ReductionBoard
from agora_worker.averaging.matchmaking import Group
from agora_worker.averaging.reducer import SliceReduction
from agora_worker.averaging.robust import Clipped, DriftHistory, Returned, bound_returned
from agora_worker.averaging.sender import contribute

# ReductionBoard is re-exported: the averager imports it from here with all_reduce.
__all__ = ["AllReduceResult", "ReductionBoard", "RoundGuard", "all_reduce", "slice_bounds"]

DEADLINE_TICK_S = 0.05  # how often reducers look for senders past their chunk deadline


def slice_bounds(length: int, reducers: int) -> list[tuple[int, int]]:
    """[start, stop) of each reducer's contiguous slice of a segment of ``length`` values."""
    edges = [length * i // reducers for i in range(reducers + 1)]
    return list(itertools.pairwise(edges))


@dataclass
class RoundGuard:
    """What keeps a round robust, carried from round to round by the averager: the drift
    histories that set the reducer's clip radius and the sender's bound, and this round's cap
    on any peer's declared weight."""

    reducing: DriftHistory  # how far senders' chunks stood from this peer's own
    receiving: DriftHistory  # how large remote reducers' differences were
    segment: int = 0  # the running round's
    weight_cap: float = float("inf")

    def close_round(self) -> None:
        self.reducing.close_round()
        self.receiving.close_round()


@dataclass
class AllReduceResult:
    pieces: list[tuple[int, np.ndarray]]  # (start in the segment, average - this peer's values)
    length: int  # values in the segment
    excluded: bool  # the reducers refused this peer's group: it averaged nothing
    reductions: list[SliceReduction]  # the slices this peer reduced
    wire_bytes: int  # tensor bytes this peer streamed to and from other peers
    evidence: list[Clipped] = dataclasses.field(default_factory=list)  # what it clipped or bounded

    @property
    def expected_inputs(self) -> int:
        return sum(r.expected_inputs for r in self.reductions)

    @property
    def averaged_fraction(self) -> float:
        """Of this peer's segment, the fraction whose average came back."""
        return sum(len(d) for _, d in self.pieces) / self.length if self.length else 1.0

    @property
    def reduce_success(self) -> float:
        """Of the inputs this peer's slices expected, the fraction that arrived in time."""
        expected = self.expected_inputs
        return sum(r.received for r in self.reductions) / expected if expected else 1.0


async def all_reduce(
    *,
    board: ReductionBoard,
    client: RpcClient,
    group: Group,
    me: str,
    values: np.ndarray,
    chunk_values: int,
    chunk_timeout_s: float,
    deadline: float,
    injections: InjectionPoints = NO_INJECTIONS,
    guard: RoundGuard | None = None,
) -> AllReduceResult:
    """One butterfly round of ``values`` (this peer's copy of the segment) within ``group``.

    Reduces this peer's slices (if it is a reducer) while it sends its copies of every slice to
    their reducers; returns by ``deadline`` (world.monotonic()) with whatever came back.
    ``guard``: clip, bound and cap (None: plain weighted means, every difference taken).
    """
    reducers = group.reducers
    bounds = slice_bounds(len(values), len(reducers))
    mine = [
        SliceReduction(
            group=group,
            slice_index=index,
            start=lo,
            stop=hi,
            chunk=chunk_values,
            chunk_timeout_s=chunk_timeout_s,
            deadline=deadline,
            me=me,
            drift=None if guard is None else guard.reducing,
            segment=0 if guard is None else guard.segment,
            weight_cap=float("inf") if guard is None else guard.weight_cap,
        )
        for index, (reducer, (lo, hi)) in enumerate(zip(reducers, bounds, strict=True))
        if reducer.node_id == me
    ]
    board.open(mine, group.round)
    ticker = asyncio.get_running_loop().create_task(_ban_late_senders(mine, deadline))
    try:
        results = await asyncio.gather(
            *(
                contribute(
                    client=client,
                    local=lambda index=index: board.reductions.get((group.round, index)),
                    group=group,
                    me=me,
                    reducer_address=reducer.address,
                    slice_index=index,
                    values=values[lo:hi],
                    start=lo,
                    chunk=chunk_values,
                    deadline=deadline,
                    injections=injections,
                )
                for index, (reducer, (lo, hi)) in enumerate(zip(reducers, bounds, strict=True))
            )
        )
        excluded = any(r.excluded for r in results)
        # Reducers keep serving the other senders until their slices are done (or time is up);
        # a peer the others excluded has nobody to serve.
        if not excluded:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await asyncio.gather(*(r.done.wait() for r in mine))
    finally:
        ticker.cancel()
        board.close(group.round)
    evidence = [c for r in mine for c in r.clipped]
    if guard is not None and guard.receiving.enabled and not excluded:
        returned = [
            Returned(slice=index, reducer=reducer.node_id, pieces=r.pieces, chunks=r.chunks)
            for index, (reducer, r) in enumerate(zip(reducers, results, strict=True))
        ]
        evidence += bound_returned(
            returned,
            me=me,
            drift=guard.receiving,
            round_index=group.round,
            segment=guard.segment,
            block=chunk_values,
        )
    # A peer that sat the round out (excluded) averaged nobody's values, not even its own slices'.
    pieces = [] if excluded else [piece for r in results for piece in r.pieces]
    wire_bytes = sum(r.wire_bytes for r in results) + sum(r.wire_bytes for r in mine)
    return AllReduceResult(pieces, len(values), excluded, mine, wire_bytes, evidence)


async def _ban_late_senders(reductions: list[SliceReduction], deadline: float) -> None:
    while world.monotonic() < deadline:
        for reduction in reductions:
            reduction.check_deadlines()
        await asyncio.sleep(DEADLINE_TICK_S)
