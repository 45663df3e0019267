"""A peer's reducer side on the wire: the ``averaging.reduce`` streams of its running rounds.

:class:`ReductionBoard` registers the method, holds the slice reductions of the rounds this
peer is in, and routes each sender's stream to its slice; :func:`serve_slice` is the reducer's
end of one such stream.
"""

from __future__ import annotations

import asyncio
import collections

import numpy as np

from agora_core.auth.access import only
from agora_core.contract import Method
from agora_core.errors import BadRequest, RpcError
from agora_core.rpc import Payload, RpcServer
from agora_worker.averaging.reducer import SliceReduction


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
                await stream.send({"chunk": index}, {"delta": difference})
                reduction.wire_bytes += difference.nbytes
                sent += 1
    except TimeoutError:
        pass
    finally:
        receiver.cancel()
        await asyncio.gather(receiver, return_exceptions=True)
    return Payload({"chunks_returned": sent, "banned": sender in reduction.banned})


class ReductionBoard:
    """A peer's reducer side: the slice reductions of its running rounds, served over a stream.

    It registers ``Method.AVERAGING_REDUCE`` on ``server``; each sender's stream names its
    round, group and slice.

    A sender may reach this peer before this peer formed its group for the round; its stream
    waits (up to ``early_wait_s``) for the round to open here. Streams for a round that is
    over, for a group that differs from the reducer's, or for a slice it does not reduce are
    refused with BadRequest: the sender then knows it was left out.
    """

    def __init__(self, server: RpcServer, *, early_wait_s: float, stage: int):
        self.reductions: dict[tuple[int, int], SliceReduction] = {}
        self._opened: dict[int, asyncio.Event] = {}
        self._closed: collections.deque[int] = collections.deque(maxlen=64)  # recent rounds
        self._early_wait_s = early_wait_s
        # Senders' chunks in flight: the node's stream window ([transport] stream_window).
        # In an authorized run only workers of this stage may stream to it.
        server.register(
            Method.AVERAGING_REDUCE, self._on_stream, stream=True, access=only(("worker",), stage=stage)
        )

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
            raise BadRequest(f"{Method.AVERAGING_REDUCE} needs round, group, slice and sender")
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
        if sender != stream.request.sender:  # authenticated in an authorized run
            raise BadRequest(f"a stream from {stream.request.sender[:12]!r} cannot send as {sender[:12]!r}")
        if digest != reduction.group.digest or sender not in reduction.senders:
            raise BadRequest(f"excluded from round {round_index}: you formed a different group (late?)")
        return await serve_slice(stream, reduction, sender)
