"""A peer's side of one slice: stream its copy to the slice's reducer, collect the differences.

One stream per (sender, slice) carries chunks to the reducer and differences back, both at
once. Where this peer reduces the slice itself, its copy goes straight into the local
:class:`~agora_worker.averaging.reducer.SliceReduction`, with no stream. What a remote reducer
returns is bounded once the round's differences are all in (:mod:`.robust`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.contract import Method
from agora_core.errors import BadRequest, RpcError
from agora_core.injection import NO_INJECTIONS, InjectionPoints, Trigger
from agora_core.observability.logs import get_logger
from agora_core.rpc import RpcClient
from agora_worker.averaging.matchmaking import Group
from agora_worker.averaging.reducer import SliceReduction, chunk_bounds

log = get_logger("worker.averaging")


@dataclass
class SliceResult:
    pieces: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (start, average - sent)
    returned: set[int] = field(default_factory=set)  # chunks whose difference came back
    excluded: bool = False  # the reducer refused this peer's group
    chunks: list[int] = field(default_factory=list)  # the chunk index of each piece
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
    injections: InjectionPoints = NO_INJECTIONS,
) -> SliceResult:
    """Send this peer's values of one slice to its reducer; collect the differences back.
    ``injections``: the operator's averaging-send trigger fires before a chunk goes out."""
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
        result.returned.add(index)
        result.pieces.append((lo, difference))
        result.chunks.append(index)

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
    remaining = deadline - world.monotonic()
    if remaining <= 0:
        return result
    try:
        async with client.open_stream(
            reducer_address, Method.AVERAGING_REDUCE, meta, timeout_s=remaining
        ) as stream:

            async def send() -> None:
                for index, (lo, hi) in enumerate(chunks):
                    if injections.armed:
                        injections.reached(Trigger.AVERAGING_SEND, index=index, count=len(chunks))
                    await stream.send({"chunk": index}, {"values": values[lo - start : hi - start]})
                    result.wire_bytes += 4 * (hi - lo)
                await stream.end()

            sender = asyncio.create_task(send())
            try:
                async for item in stream:
                    difference = np.asarray(item.tensors["delta"], dtype=np.float32)
                    result.wire_bytes += difference.nbytes
                    take(item.meta["chunk"], difference)
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
