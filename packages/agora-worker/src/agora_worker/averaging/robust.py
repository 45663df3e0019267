"""Robust averaging: what a peer's values may do to this one's, whatever the peer claims.

An admitted peer can lie in a round: send its values scaled, flipped or noisy, declare a huge
weight, or, as a reducer, return differences that would drag its senders anywhere. Three
bounds hold against that, each at the place the value is used:

- **Self-centred clipping at the reducer.** A reducer holds its own copy of every chunk it
  reduces. Each other sender's chunk enters the weighted mean only as far as ``radius`` from
  that copy: ``c + (v - c) * min(1, radius / |v - c|)``. An honest reducer's mean therefore
  moves at most ``radius`` from its own values, with any group, of two peers too. (The
  clipped share is folded into the reducer's own weight: the kernel stays one weighted sum.)
- **A bounded difference at the sender.** A sender applies at most ``radius`` of each
  difference a remote reducer returns, so a lying reducer moves it no further.
- **A capped weight.** A peer's declared weight (its samples since its last round) counts at
  most :func:`weight_cap`: a multiple of the reducer's own, and never above the samples a whole
  stage processes between rounds.

The radius is ``averaging.clip_multiplier`` times the honest drift: how far, per value (root
mean square), the other peers' copies of the same chunk stand from this peer's. With two or
more others that is the lower median of this round's distances (a lying minority cannot raise
it; it follows a run whose drift shrinks or grows). With one other, which may be the liar, it
is the median over that block's recent visits (:class:`DriftHistory`); only distances inside
the radius are recorded, so a liar cannot widen it by lying. A block seen fewer than three
times with one other peer has nothing to hold the other against and is not clipped: the first
visits of a pair trust each other.

A sender holds each remote reducer's differences against its history of the differences
that block of the segment brought before (other reducers' slices hold other parameters,
whose drift says nothing about this one's); a block seen fewer than three times is taken
as it comes.

Every clip is evidence (:class:`Clipped`): the round, slice, chunk, peer, its distance and the
radius, kept by the averager for the accusations that follow.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_HISTORY_ROUNDS = 3  # visits of a block recorded before its history alone sets a radius
BLOCK_VALUES = 64 * 1024  # distances are taken in blocks this long: each block stays in cache


@dataclass(frozen=True)
class Clipped:
    """One clipped contribution: ``peer``'s chunk stood ``rms`` per value from this peer's
    copy (a reducer's view) or returned a difference of ``rms`` (a sender's view), past
    ``radius`` per value; or (``role`` "weight", ``chunk`` -1) it declared a weight of
    ``rms`` samples where the cap was ``radius``."""

    round: int
    slice: int
    chunk: int
    peer: str
    role: str  # "sender": clipped by this reducer; "reducer": bounded by this sender; "weight"
    rms: float
    radius: float


def lower_median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


class DriftHistory:
    """How far honest copies stood apart in recent rounds, block by block; the clip radius.

    Drift differs between parameters (a frozen or rarely-hit one barely moves), so it is kept
    per block of a segment (``key``: the segment and the block's index in it) and a chunk is
    only ever held against its own block's past.
    """

    def __init__(self, *, multiplier: float, rounds: int):
        """``multiplier`` 0: no radius (clipping off); ``rounds``: visits remembered per block."""
        self.multiplier = multiplier
        self.rounds = max(1, rounds)
        self._blocks: dict[Hashable, collections.deque[float]] = {}
        self._this_round: dict[Hashable, list[float]] = {}

    @property
    def enabled(self) -> bool:
        return self.multiplier > 0

    def typical(self, key: Hashable) -> float | None:
        """The median of the block's recorded drift; None until enough visits were recorded."""
        past = self._blocks.get(key)
        if past is None or len(past) < MIN_HISTORY_ROUNDS:
            return None
        return statistics.median(past)

    def radius(self, key: Hashable, current: Sequence[float] = ()) -> float:
        """The radius per value (inf: no bound) for block ``key``, whose other copies stood
        ``current`` away this round: the lower median of those with two or more (a lying
        minority cannot raise it), else the block's typical drift (one peer alone may be the
        liar)."""
        if not self.enabled:
            return math.inf
        base = lower_median(list(current)) if len(current) >= 2 else self.typical(key)
        return math.inf if base is None else self.multiplier * base

    def observe(self, key: Hashable, rms: float) -> None:
        """A distance inside the radius, seen in the running round."""
        if math.isfinite(rms):
            self._this_round.setdefault(key, []).append(rms)

    def close_round(self) -> None:
        """Record each block's median distance in the running round."""
        for key, seen in self._this_round.items():
            past = self._blocks.get(key)
            if past is None:
                past = self._blocks[key] = collections.deque(maxlen=self.rounds)
            past.append(statistics.median(seen))
        self._this_round = {}


def block_key(segment: int, start: int, block: int) -> tuple[int, int]:
    """The history key of the values from ``start`` in ``segment``, in blocks of ``block``."""
    return segment, start // max(1, block)


def rms_distance(values: np.ndarray, centre: np.ndarray, scratch: np.ndarray | None = None) -> float:
    """sqrt(mean((values - centre)^2)), in cache-sized blocks (no full-size temporary)."""
    length = len(values)
    if length == 0:
        return 0.0
    block = max(1, min(BLOCK_VALUES, length))
    if scratch is None or len(scratch) < block:
        scratch = np.empty(block, np.float32)
    total = 0.0
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        part = scratch[: hi - lo]
        np.subtract(values[lo:hi], centre[lo:hi], out=part)
        total += float(np.dot(part, part))
    return math.sqrt(total / length)


def clip_factor(rms: float, radius: float) -> float:
    """How much of a deviation of ``rms`` per value counts under ``radius`` (1: all of it)."""
    if not math.isfinite(rms):
        return 0.0
    return 1.0 if rms <= radius else radius / rms


def weight_cap(
    *, own: float, members: int, cadence_steps: int, target_batch_size: int, ratio: float
) -> float:
    """The most weight a reducer counts for any peer: ``ratio`` times its own (while its own is
    0, times a fair share of a round's samples), never above twice the samples a whole stage
    processes between rounds (a peer that missed a round brings two rounds' worth)."""
    per_round = float(cadence_steps * target_batch_size)
    if ratio <= 0:
        return 2 * per_round
    reference = own if own > 0 else per_round / max(1, members)
    return min(2 * per_round, ratio * reference)


@dataclass
class Returned:
    """What one slice's reducer sent back to this peer: (start, difference) pieces and the
    chunk index of each."""

    slice: int
    reducer: str
    pieces: list[tuple[int, np.ndarray]]
    chunks: list[int]


def piece_rms(difference: np.ndarray) -> float:
    return math.sqrt(float(np.dot(difference, difference)) / max(1, len(difference)))


def bound_returned(
    returned: list[Returned], *, me: str, drift: DriftHistory, round_index: int, segment: int, block: int
) -> list[Clipped]:
    """Bound, in place, every remote reducer's differences to their block's radius (its own
    history: slices hold different parameters, so reducers are not compared with each other);
    drop non-finite ones (those values keep their local progress). This peer's own slices are
    not bounded: they are its own reduction. Returns the evidence."""
    evidence: list[Clipped] = []
    for r in returned:
        if r.reducer == me:
            continue
        kept_pieces, kept_chunks = [], []
        for (start, difference), chunk in zip(r.pieces, r.chunks, strict=True):
            key = block_key(segment, start, block)
            rms = piece_rms(difference)
            radius = drift.radius(key)
            factor = clip_factor(rms, radius)
            if factor >= 1.0:
                drift.observe(key, rms)
            else:
                evidence.append(Clipped(round_index, r.slice, chunk, r.reducer, "reducer", rms, radius))
                if factor == 0.0:
                    continue
                difference = difference * np.float32(factor)
            kept_pieces.append((start, difference))
            kept_chunks.append(chunk)
        r.pieces[:], r.chunks[:] = kept_pieces, kept_chunks
    return evidence
