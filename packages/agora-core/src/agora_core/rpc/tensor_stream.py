"""Send one large tensor over a stream in chunks, and rebuild it as the chunks arrive.

A tensor bigger than one message (``WireLimits.max_message_bytes``) travels as stream items of
``chunk_bytes`` each. The first item declares dtype, shape and total size; the receiver checks
the declaration against its own limit, allocates the result once, and copies each chunk into
place on arrival, so it holds the result plus at most one stream window of chunks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from agora_core.errors import BadRequest, LimitExceeded
from agora_core.rpc.streams import StreamChannel
from agora_core.rpc.types import Payload
from agora_core.wire.dtypes import TaggedArray, Tensor, as_wire_array, is_tagged_only, itemsize, storage_dtype

DEFAULT_CHUNK_BYTES = 2 << 20


async def send_tensor(
    channel: StreamChannel, tensor: Tensor, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES, meta: Any = None
) -> int:
    """Stream ``tensor`` as items of ``chunk_bytes``; returns the number of items sent."""
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    dtype, array = as_wire_array(tensor)
    data = array.reshape(-1).view(np.uint8)
    total = data.nbytes
    count = max(1, math.ceil(total / chunk_bytes))
    for index in range(count):
        offset = index * chunk_bytes
        item_meta = {"offset": offset}
        if index == 0:
            item_meta.update(dtype=dtype, shape=list(array.shape), total_bytes=total, user=meta)
        await channel.send(item_meta, {"chunk": data[offset : offset + chunk_bytes]})
    return count


class TensorAssembler:
    """Rebuilds a tensor sent by :func:`send_tensor`, one item at a time."""

    def __init__(self, *, max_bytes: int):
        self.max_bytes = max_bytes
        self.meta: Any = None  # the sender's ``meta``
        self._dtype = ""
        self._shape: tuple[int, ...] = ()
        self._flat: np.ndarray | None = None
        self._received = 0
        self._total = -1

    @property
    def complete(self) -> bool:
        return self._received == self._total

    @property
    def received_bytes(self) -> int:
        return self._received

    def add(self, item: Payload) -> None:
        """Place one chunk; raises BadRequest/LimitExceeded for an inconsistent stream."""
        meta = item.meta if isinstance(item.meta, dict) else {}
        chunk = item.tensors.get("chunk")
        if not isinstance(chunk, np.ndarray) or chunk.dtype != np.uint8 or chunk.ndim != 1:
            raise BadRequest("tensor stream item lacks a 1-D uint8 'chunk'")
        if self._flat is None:
            self._declare(meta)
        offset = meta.get("offset")
        if offset != self._received:  # streams are ordered: chunks arrive back to back
            raise BadRequest(f"chunk at offset {offset!r} arrived, expected {self._received}")
        end = offset + chunk.nbytes
        if end > self._total:
            raise BadRequest(f"chunk ends at byte {end}, past the declared {self._total}")
        self._flat[offset:end] = chunk
        self._received = end

    def _declare(self, meta: dict) -> None:
        dtype, shape, total = meta.get("dtype"), meta.get("shape"), meta.get("total_bytes")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise BadRequest("first tensor stream item must declare dtype and shape")
        try:
            size = itemsize(dtype)
        except KeyError:
            raise BadRequest(f"unsupported dtype {dtype[:32]!r}") from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise BadRequest("shape must be a list of non-negative ints")
        nbytes = size * math.prod(shape)
        if total != nbytes:
            raise BadRequest(f"declared total_bytes {total!r} does not match {dtype}{shape}")
        if nbytes > self.max_bytes:
            raise LimitExceeded(f"streamed tensor of {nbytes} bytes exceeds the limit {self.max_bytes}")
        self._dtype, self._shape, self._total = dtype, tuple(shape), nbytes
        self.meta = meta.get("user")
        self._flat = np.empty(nbytes, dtype=np.uint8)

    def result(self) -> Tensor:
        if self._flat is None or not self.complete:
            raise BadRequest(f"tensor stream incomplete: {self._received} of {self._total} bytes")
        array = self._flat.view(storage_dtype(self._dtype)).reshape(self._shape)
        return TaggedArray(self._dtype, array) if is_tagged_only(self._dtype) else array


async def receive_tensor(channel: StreamChannel, *, max_bytes: int) -> tuple[Tensor, Any]:
    """Consume a stream produced by :func:`send_tensor`; returns ``(tensor, meta)``."""
    assembler = TensorAssembler(max_bytes=max_bytes)
    while not assembler.complete:
        item = await channel.receive()
        if item is None:
            raise BadRequest(f"stream ended after {assembler.received_bytes} bytes of a tensor stream")
        assembler.add(item)
    return assembler.result(), assembler.meta
