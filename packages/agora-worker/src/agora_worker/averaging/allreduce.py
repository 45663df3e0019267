"""Butterfly all-reduce of one segment: a reduce-scatter and an all-gather, in one pass.

The segment is cut into one contiguous slice per reducer. Every peer streams its copy of each
slice to that slice's reducer in fixed-size chunks; the reducer queues each chunk as it
arrives and, once a chunk has come in from every live sender, takes their weighted average
and streams back to each sender the *difference* between the average and that sender's
chunk, while the next chunks are still on their way. Sending and reducing overlap: one
stream per (sender, slice) carries chunks one way and differences the other. A sender that
misses a chunk's deadline is banned for the round and the chunk is averaged over the others;
a difference that never comes back leaves the local values alone.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from agora_core.errors import BadRequest, RpcError
from agora_core.logs import get_logger
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_worker.averaging.matchmaking import Group

log = get_logger("worker.averaging")

METHOD = "averaging.reduce"
DEADLINE_TICK_S = 0.05  # how often reducers look for senders past their chunk deadline
BLOCK_VALUES = 64 * 1024  # a chunk is reduced in blocks this long: each block's work stays in cache


def slice_bounds(length: int, reducers: int) -> list[tuple[int, int]]:
    """[start, stop) of each reducer's contiguous slice of a segment of ``length`` values."""
    edges = [length * i // reducers for i in range(reducers + 1)]
    return list(itertools.pairwise(edges))


def chunk_bounds(start: int, stop: int, chunk: int) -> list[tuple[int, int]]:
    return [(i, min(i + chunk, stop)) for i in range(start, stop, chunk)] or [(start, stop)]


@dataclass
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
    deadline: float  # time.monotonic() by which the round ends, reduced or not
    compress: bool = True  # differences go back LZ4-compressed where a chunk pays for it
    clock: Callable[[], float] = time.monotonic  # when chunks arrive (tests drive their own)
    # chunk -> sender -> (its values, whether its difference may overwrite them)
    _inputs: dict[int, dict[str, tuple[np.ndarray, bool]]] = field(default_factory=dict)
    _last_heard: dict[str, float] = field(default_factory=dict)  # sender -> its latest input (or the start)
    _done: set[int] = field(default_factory=set)
    banned: set[str] = field(default_factory=set)
    outboxes: dict[str, asyncio.Queue] = field(default_factory=dict)  # sender -> (chunk, difference)
    received: int = 0  # (sender, chunk) inputs that arrived in time
    heard_from: set[str] = field(default_factory=set)  # senders with at least one input in
    wire_bytes: int = 0  # chunks streamed in from other peers plus differences streamed back

    def __post_init__(self) -> None:
        self.done = asyncio.Event()  # every chunk averaged (or given up on)
        self.chunks = chunk_bounds(self.start, self.stop, self.chunk)
        self.senders = {m.node_id: m.weight for m in self.group.members}
        self._last_heard = dict.fromkeys(self.senders, self.clock())
        for node_id in self.senders:
            self.outboxes[node_id] = asyncio.Queue()

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

    def _shares(self, live: list[str]) -> list[np.float32]:
        """Each live sender's weight over the live total (a plain mean if nobody has samples)."""
        total = sum(self.senders[s] for s in live)
        if total <= 0:
            return [np.float32(1.0 / len(live))] * len(live)
        return [np.float32(self.senders[s] / total) for s in live]

    def _try_finish(self, index: int) -> None:
        inputs = self._inputs.get(index, {})
        live = self.live()
        if index in self._done or not live or any(s not in inputs for s in live):
            return
        values = [inputs[s][0] for s in live]
        # A received buffer takes its sender's difference in place; the reducer's own values
        # (its snapshot) get a new one.
        outs = [v if reusable else np.empty_like(v) for v, reusable in (inputs[s] for s in live)]
        _average_minus_each(values, self._shares(live), outs)
        for sender, difference in zip(live, outs, strict=True):
            self.outboxes[sender].put_nowait((index, difference))
        self._done.add(index)
        del self._inputs[index]
        if self.finished:
            for sender in self.live():
                self.outboxes[sender].put_nowait(None)
            self.done.set()


def _average_minus_each(values: list[np.ndarray], shares: list[np.float32], outs: list[np.ndarray]) -> None:
    """outs[i] = sum_j shares[j] * values[j] - values[i]; an out may be its own values' buffer."""
    length = len(values[0])
    block = max(1, min(BLOCK_VALUES, length))
    average, term = np.empty(block, np.float32), np.empty(block, np.float32)
    for lo in range(0, length, block):
        hi = min(lo + block, length)
        mean, scratch = average[: hi - lo], term[: hi - lo]
        np.multiply(values[0][lo:hi], shares[0], out=mean)
        for array, share in zip(values[1:], shares[1:], strict=True):
            np.add(mean, np.multiply(array[lo:hi], share, out=scratch), out=mean)
        for array, out in zip(values, outs, strict=True):  # each block read back while cached
            np.subtract(mean, array[lo:hi], out=out[lo:hi])


@dataclass
class SliceResult:
    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (start, average - sent)
    returned: set[int] = field(default_factory=set)  # chunks whose difference came back
    excluded: bool = False  # the reducer refused this peer's group
    wire_bytes: int = 0  # chunks streamed to a remote reducer plus differences streamed back


async def contribute(
    *,
    client: RpcClient,
    local: Callable[[], SliceReduction | None],
    group: Group,
    me: str,
    reducer_address: str,
    slice_index: int,
    values: np.ndarray,
    start: int,
    chunk: int,
    deadline: float,
    compress: bool = True,
    window: int | None = None,
) -> SliceResult:
    """Send this peer's values of one slice to its reducer; collect the differences back."""
    stop = start + len(values)
    chunks = chunk_bounds(start, stop, chunk)
    result = SliceResult()

    def take(index: int, difference: np.ndarray) -> None:
        # Kept as received (no copy into a dense delta): the averager adds each piece in place.
        if not 0 <= index < len(chunks) or index in result.returned:
            raise ValueError(f"the reducer returned chunk {index!r} twice or out of range")
        lo, hi = chunks[index]
        if difference.shape != (hi - lo,):
            raise ValueError(f"chunk {index} difference must hold {hi - lo} values, got {difference.shape}")
        result.pieces.append((lo, difference))
        result.returned.add(index)

    reduction = local()
    if reduction is not None:  # this peer reduces the slice itself
        for index, (lo, hi) in enumerate(chunks):
            reduction.add(me, index, values[lo - start : hi - start])
        outbox = reduction.outboxes[me]
        try:
            async with asyncio.timeout_at(deadline):
                while (item := await outbox.get()) is not None:
                    take(*item)
        except TimeoutError:
            pass
        return result
    meta = {"round": group.round, "group": group.digest, "slice": slice_index, "sender": me}
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return result
    try:
        async with client.open_stream(
            reducer_address, METHOD, meta, timeout_s=remaining, window=window
        ) as stream:

            async def send() -> None:
                for index, (lo, hi) in enumerate(chunks):
                    await stream.send(
                        {"chunk": index}, {"values": values[lo - start : hi - start]}, compress=compress
                    )
                    result.wire_bytes += 4 * (hi - lo)
                await stream.end()

            sender = asyncio.create_task(send())
            try:
                async for item in stream:
                    difference = np.asarray(item.tensors["delta"], dtype=np.float32)
                    take(item.meta["chunk"], difference)
                    result.wire_bytes += difference.nbytes
                await stream.result()
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
    except BadRequest as exc:  # the reducer formed another group: this peer sits the round out
        result.excluded = True
        log.info("averaging_excluded", round=group.round, slice=slice_index, error=str(exc))
    except (RpcError, TimeoutError, KeyError, TypeError, ValueError) as exc:
        log.info("averaging_slice_incomplete", round=group.round, slice=slice_index, error=str(exc))
    return result


async def serve_slice(stream, reduction: SliceReduction, sender: str) -> Payload:
    """The reducer's end of one sender's stream: take its chunks, send its differences."""

    async def receive() -> None:
        try:
            async for item in stream:
                index = item.meta.get("chunk") if isinstance(item.meta, dict) else None
                values = item.tensors.get("values")
                if not isinstance(index, int) or not 0 <= index < len(reduction.chunks) or values is None:
                    raise ValueError("a chunk item is {'chunk': i} with a 'values' tensor")
                values = np.asarray(values, dtype=np.float32)
                reduction.wire_bytes += values.nbytes
                reduction.add(sender, index, values, owned=True)
        except (RpcError, ValueError, TypeError) as exc:
            reduction.ban(sender, f"stream broke: {exc}")

    receiver = asyncio.create_task(receive())
    outbox = reduction.outboxes[sender]
    sent = 0
    try:
        async with asyncio.timeout_at(reduction.deadline):
            while (item := await outbox.get()) is not None:
                index, difference = item
                await stream.send({"chunk": index}, {"delta": difference}, compress=reduction.compress)
                reduction.wire_bytes += difference.nbytes
                sent += 1
    except TimeoutError:
        pass
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
    return Payload({"chunks_returned": sent, "banned": sender in reduction.banned})


@dataclass
class AllReduceResult:
    pieces: list[tuple[int, np.ndarray]]  # (start in the segment, average - this peer's values)
    length: int  # values in the segment
    excluded: bool  # the reducers refused this peer's group: it averaged nothing
    reductions: list[SliceReduction]  # the slices this peer reduced
    wire_bytes: int  # tensor bytes this peer streamed to and from other peers

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


class ReductionBoard:
    """A peer's reducer side: the slice reductions of its running rounds, served over METHOD.

    A sender may reach this peer before this peer formed its group for the round; its stream
    waits (up to ``early_wait_s``) for the round to open here. Streams for a round that is
    over, for a group that differs from the reducer's, or for a slice it does not reduce are
    refused with BadRequest: the sender then knows it was left out.
    """

    def __init__(self, server: RpcServer, *, early_wait_s: float, window: int | None = None):
        self.reductions: dict[tuple[int, int], SliceReduction] = {}
        self._opened: dict[int, asyncio.Event] = {}
        self._closed: collections.deque[int] = collections.deque(maxlen=64)  # recent rounds
        self._early_wait_s = early_wait_s
        self.window = window  # chunks a sender may have in flight to this reducer
        server.register(METHOD, self._on_stream, stream=True, window=window)

    def open(self, reductions: list[SliceReduction], round_index: int) -> None:
        for reduction in reductions:
            self.reductions[(round_index, reduction.slice_index)] = reduction
        self._opened.setdefault(round_index, asyncio.Event()).set()

    def close(self, round_index: int) -> None:
        for key in [k for k in self.reductions if k[0] == round_index]:
            del self.reductions[key]
        self._opened.pop(round_index, None)
        self._closed.append(round_index)

    def running(self) -> list[SliceReduction]:
        return list(self.reductions.values())

    async def _on_stream(self, stream) -> Payload:
        meta = stream.request.meta if isinstance(stream.request.meta, dict) else {}
        round_index, digest, index, sender = (meta.get(k) for k in ("round", "group", "slice", "sender"))
        if not isinstance(round_index, int) or not isinstance(index, int) or not isinstance(sender, str):
            raise BadRequest(f"{METHOD} needs round, group, slice and sender")
        if round_index in self._closed:
            raise BadRequest(f"excluded from round {round_index}: it is over here (you came late)")
        opened = self._opened.setdefault(round_index, asyncio.Event())
        try:
            async with asyncio.timeout(self._early_wait_s):
                await opened.wait()
        except TimeoutError:
            raise BadRequest(f"round {round_index} is not running here") from None
        reduction = self.reductions.get((round_index, index))
        if reduction is None:
            raise BadRequest(f"this peer does not reduce slice {index} of round {round_index}")
        if digest != reduction.group.digest or sender not in reduction.senders:
            raise BadRequest(f"excluded from round {round_index}: you formed a different group (late?)")
        return await serve_slice(stream, reduction, sender)


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
    compress: bool = True,
) -> AllReduceResult:
    """One butterfly round of ``values`` (this peer's copy of the segment) within ``group``.

    Reduces this peer's slices (if it is a reducer) while it sends its copies of every slice to
    their reducers; returns by ``deadline`` (time.monotonic()) with whatever came back.
    """
    reducers = group.reducers
    bounds = slice_bounds(len(values), len(reducers))
    mine = [
        SliceReduction(group, index, lo, hi, chunk_values, chunk_timeout_s, deadline, compress)
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
                    compress=compress,
                    window=board.window,  # differences in flight back: as many as chunks out
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
    # A peer that sat the round out (excluded) averaged nobody's values, not even its own slices'.
    pieces = [] if excluded else [piece for r in results for piece in r.pieces]
    wire_bytes = sum(r.wire_bytes for r in results) + sum(r.wire_bytes for r in mine)
    return AllReduceResult(pieces, len(values), excluded, mine, wire_bytes)


async def _ban_late_senders(reductions: list[SliceReduction], deadline: float) -> None:
    while time.monotonic() < deadline:
        for reduction in reductions:
            reduction.check_deadlines()
        await asyncio.sleep(DEADLINE_TICK_S)
