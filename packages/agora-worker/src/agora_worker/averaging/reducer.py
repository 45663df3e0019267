"""A reducer's work on one slice of a segment for one round: its state and the numpy kernel.

Chunks of the slice arrive from every sender of the group (:mod:`.board` feeds remote ones in,
:mod:`.sender` this peer's own); once a chunk has come in from every live sender, the weighted
average is taken and each sender's difference (average minus its chunk) is queued in its
outbox. The average is robust (:mod:`.robust`): other senders' chunks are clipped to a radius
around this peer's own, and their declared weights capped. No networking here: the reduction
is driven by calls and read through its outboxes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.observability.logs import get_logger
from agora_worker.averaging.matchmaking import Group
from agora_worker.averaging.robust import Clipped, DriftHistory, block_key, clip_factor, rms_distance

log = get_logger("worker.averaging")

BLOCK_VALUES = 64 * 1024  # a chunk is reduced in blocks this long: each block's work stays in cache


def chunk_bounds(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk, stop)) for i in range(start, stop, chunk)] or [(start, stop)]


@dataclass(kw_only=True)
class SliceReduction:
    """A reducer's work on one slice for one round: averages chunks, hands out differences.

    Chunks are reduced one at a time, as soon as every live sender's copy is in, while later
    chunks are still arriving. A chunk's inputs are kept until then in any case (each sender
    gets the average minus its own values back), so the weighted sum is taken at that moment,
    in cache-sized blocks: every input is read from memory once, where summing on arrival
    would read it a second time for the difference -- the reduction's main cost.
    """

    group: Group
    slice_index: int
    start: int
    stop: int
    chunk: int  # values per chunk
    chunk_timeout_s: float
    deadline: float  # world.monotonic() by which the round ends, reduced or not
    clock: Callable[[], float] = lambda: world.monotonic()  # when chunks arrive (tests drive their own)
    # Robustness (.robust): this peer's id (its chunks are the centre other senders are clipped
    # around; None: a plain weighted mean), its drift history (the radius), the weight cap.
    me: str | None = None
    drift: DriftHistory | None = None
    segment: int = 0  # the round's segment: with the chunk's start, its drift history's key
    weight_cap: float = float("inf")
    # chunk -> sender -> (its values, whether its difference may overwrite them)
    _inputs: dict[int, dict[str, tuple[np.ndarray, bool]]] = field(default_factory=dict)
    _last_heard: dict[str, float] = field(default_factory=dict)  # sender -> its latest input (or the start)
    _done: set[int] = field(default_factory=set)
    banned: set[str] = field(default_factory=set)
    outboxes: dict[str, asyncio.Queue] = field(default_factory=dict)  # sender -> (chunk, difference)
    received: int = 0  # (sender, chunk) inputs that arrived in time
    heard_from: set[str] = field(default_factory=set)  # senders with at least one input in
    wire_bytes: int = 0  # chunks streamed in from other peers plus differences streamed back
    clipped: list[Clipped] = field(default_factory=list)  # evidence: contributions clipped here

    def __post_init__(self) -> None:
        self.done = asyncio.Event()  # every chunk averaged (or given up on)
        self.chunks = chunk_bounds(self.start, self.stop, self.chunk)
        self.senders = {m.node_id: m.weight for m in self.group.members}
        self._last_heard = dict.fromkeys(self.senders, self.clock())
        for node_id in self.senders:
            self.outboxes[node_id] = asyncio.Queue()
        for node_id, declared in self.senders.items():  # a weight past the cap is evidence too
            if node_id != self.me and declared > self.weight_cap:
                self.clipped.append(
                    Clipped(
                        self.group.round, self.slice_index, -1, node_id, "weight", declared, self.weight_cap
                    )
                )

    @property
    def expected_inputs(self) -> int:
        return len(self.chunks) * len(self.senders)

    @property
    def finished(self) -> bool:
        return len(self._done) == len(self.chunks)

    @property
    def pending(self) -> list[int]:
        return [i for i in range(len(self.chunks)) if i not in self._done]

    def live(self) -> list[str]:
        return [s for s in self.senders if s not in self.banned]

    def add(self, sender: str, index: int, values: np.ndarray, *, owned: bool = False) -> None:
        """One sender's chunk. Raises ValueError for chunks that do not fit the layout.

        ``owned``: ``values`` is a buffer this reduction may overwrite (a received chunk): the
        sender's difference is then computed in place, with no new buffer.
        """
        if sender not in self.senders or sender in self.banned or index in self._done:
            return  # late, excluded, or already averaged without it
        start, stop = self.chunks[index]
        if values.shape != (stop - start,):
            raise ValueError(f"chunk {index} must hold {stop - start} values, got {values.shape}")
        self._inputs.setdefault(index, {})[sender] = (values, owned and values.flags.writeable)
        self.heard_from.add(sender)
        self._last_heard[sender] = self.clock()
        self.received += 1
        self._try_finish(index)

    def ban(self, sender: str, why: str) -> None:
        if sender in self.banned or sender not in self.senders:
            return
        self.banned.add(sender)
        log.info(
            "averaging_sender_banned",
            round=self.group.round,
            slice=self.slice_index,
            sender=sender[:12],
            why=why,
        )
        self.outboxes[sender].put_nowait(None)  # nothing more for it
        for index, inputs in list(self._inputs.items()):
            inputs.pop(sender, None)  # its chunks are averaged without it
            self._try_finish(index)

    def check_deadlines(self) -> None:
        """Ban live senders that still owe chunks and sent none for ``chunk_timeout_s``.

        Each sender's next chunk is due within the timeout of its previous one (or of the
        round's start), so a sender that is merely slower than the others -- a thinner uplink,
        busy returning its own differences -- is never banned, and a dead one is banned one
        timeout after its last chunk.
        """
        now = self.clock()
        for sender in self.live():
            if now - self._last_heard[sender] < self.chunk_timeout_s:
                continue
            owed = [i for i in self.pending if sender not in self._inputs.get(i, {})]
            if owed:
                self.ban(sender, f"sent no chunk for {self.chunk_timeout_s:g} s (owes chunk {owed[0]})")

    def _weight(self, sender: str) -> float:
        declared = self.senders[sender]
        return declared if sender == self.me else min(declared, self.weight_cap)

    def _shares(self, live: list[str]) -> list[float]:
        """Each live sender's (capped) weight over the live total (a plain mean if nobody has
        samples)."""
        weights = [self._weight(s) for s in live]
        total = sum(weights)
        if total <= 0:
            return [1.0 / len(live)] * len(live)
        return [w / total for w in weights]

    def _clip(self, index: int, live: list[str], values: list[np.ndarray], shares: list[float]) -> None:
        """Self-centred clipping of chunk ``index``: each other sender's share shrinks by its
        clip factor, the rest going to this peer's own values (the centre)."""
        if self.me not in live or self.drift is None or not self.drift.enabled:
            return
        mine = live.index(self.me)
        centre = values[mine]
        scratch = np.empty(max(1, min(len(centre), BLOCK_VALUES)), np.float32)
        distances = {i: rms_distance(values[i], centre, scratch) for i in range(len(live)) if i != mine}
        key = block_key(self.segment, self.chunks[index][0], self.chunk)
        radius = self.drift.radius(key, [d for d in distances.values() if np.isfinite(d)])
        for i, rms in distances.items():
            factor = clip_factor(rms, radius)
            if factor >= 1.0:
                self.drift.observe(key, rms)
                continue
            if shares[i] <= 0:
                continue  # a sender of no weight (a syncing joiner) moves nothing: no evidence
            shares[mine] += shares[i] * (1.0 - factor)
            shares[i] *= factor
            evidence = Clipped(
                round=self.group.round,
                slice=self.slice_index,
                chunk=index,
                peer=live[i],
                role="sender",
                rms=rms,
                radius=radius,
            )
            self.clipped.append(evidence)

    def _try_finish(self, index: int) -> None:
        inputs = self._inputs.get(index, {})
        live = self.live()
        if index in self._done or not live or any(s not in inputs for s in live):
            return
        values = [inputs[s][0] for s in live]
        # A received buffer takes its sender's difference in place; the reducer's own values
        # (its snapshot) get a new one.
        outs = [v if reusable else np.empty_like(v) for v, reusable in (inputs[s] for s in live)]
        shares = self._shares(live)
        self._clip(index, live, values, shares)
        _average_minus_each(values, [np.float32(share) for share in shares], outs)
        for sender, difference in zip(live, outs, strict=True):
            self.outboxes[sender].put_nowait((index, difference))
        self._done.add(index)
        del self._inputs[index]
        if self.finished:
            for sender in self.live():
                self.outboxes[sender].put_nowait(None)
            self.done.set()


def _average_minus_each(values: list[np.ndarray], shares: list[np.float32], outs: list[np.ndarray]) -> None:
    """outs[i] = sum_j shares[j] * values[j] - values[i]; an out may be its own values' buffer.
    Values of share 0 stay out of the sum (a clipped-out chunk may hold NaN)."""
    length = len(values[0])
    block = max(1, min(BLOCK_VALUES, length))
    average, term = np.empty(block, np.float32), np.empty(block, np.float32)
    counted = [(array, share) for array, share in zip(values, shares, strict=True) if share != 0]
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        mean, scratch = average[: hi - lo], term[: hi - lo]
        mean.fill(0.0)
        for array, share in counted:
            np.add(mean, np.multiply(array[lo:hi], share, out=scratch), out=mean)
        for array, out in zip(values, outs, strict=True):  # each block read back while cached
            np.subtract(mean, array[lo:hi], out=out[lo:hi])
