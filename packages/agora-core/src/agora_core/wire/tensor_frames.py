"""Tensors as data frames: descriptors, chunking, and the checks a receiver makes on both.

A tensor travels as a descriptor in the header (``{name, dtype, shape, chunk_bytes, chunks,
codecs, sizes}``) and data frames after it: its bytes are cut into chunks of ``chunk_bytes``,
each raw or LZ4 (when that pays); each LZ4 chunk is a frame of its own and consecutive raw
chunks share one. Raw frames are views of the sender's array, not copies. A receiver checks
every descriptor against :class:`~agora_core.wire.WireLimits` and the frames it got before it
allocates a byte; a single raw frame becomes the array without a copy. The header around the
descriptors is :mod:`agora_core.wire.message`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from agora_core.errors import LimitExceeded, MalformedMessage, WireError
from agora_core.wire.codec import CODEC_LZ4, CODEC_RAW, CompressionPolicy, decode_lz4, encode_chunk
from agora_core.wire.dtypes import (
    TaggedArray,
    Tensor,
    as_wire_array,
    is_tagged_only,
    itemsize,
    storage_dtype,
)

if TYPE_CHECKING:
    from agora_core.wire.message import WireConfig, WireLimits


def exact_int(value: Any) -> bool:
    return type(value) is int  # msgpack decodes integers to exactly int; bool is not one here


# --- encoding ------------------------------------------------------------------------------


_RAW_ONLY = CompressionPolicy(enabled=False)


def _tensor_frames(
    name: str, tensor: Tensor, config: WireConfig, compress: bool
) -> tuple[dict[str, Any], list[Any], int]:
    dtype, array = as_wire_array(tensor)
    nbytes = array.nbytes
    step = config.chunk_bytes
    policy = config.compression if compress else _RAW_ONLY
    codecs: list[int] = []
    sizes: list[int] = []
    frames: list[Any] = []  # memoryviews, LZ4 bytes, or a whole buffer's own object
    if nbytes:
        data = memoryview(array.reshape(-1).view(np.uint8))
        run_start = None  # start of the current run of raw chunks, sent as one frame
        for start in range(0, nbytes, step):
            codec, payload = encode_chunk(data[start : start + step], policy)
            codecs.append(codec)
            sizes.append(len(payload))
            if codec == CODEC_RAW:
                if run_start is None:
                    run_start = start
                continue
            if run_start is not None:
                frames.append(data[run_start:start])
                run_start = None
            frames.append(payload)
        if run_start is not None:
            # All of a received message's buffer, sent on (a reducer returns a difference in
            # the buffer its chunk came in): the buffer's own object goes, so a transport
            # that made it can pass it on by reference (zmq: no new frame, no release thread).
            whole = _whole_buffer(array) if run_start == 0 and nbytes >= _WHOLE_BUFFER_MIN_BYTES else None
            frames.append(data[run_start:] if whole is None else whole)
    descriptor = {
        "name": name,
        "dtype": dtype,
        "shape": list(array.shape),
        "chunk_bytes": step,
        "chunks": len(codecs),
        "codecs": codecs,
        "sizes": sizes,
    }
    return descriptor, frames, nbytes


_WHOLE_BUFFER_MIN_BYTES = 64 * 1024  # below this a transport copies anyway


def _whole_buffer(array: np.ndarray) -> Any:
    """The object exporting ``array``'s memory if ``array`` spans exactly all of it, else None.

    A C-contiguous array holding as many bytes as its exporter's whole buffer can only be that
    buffer, start to end.
    """
    owner = array.base
    while isinstance(owner, np.ndarray):
        owner = owner.base
    if isinstance(owner, memoryview):
        owner = owner.obj
    if owner is None or isinstance(owner, (bytes, bytearray, memoryview)):
        return None  # plain buffers gain nothing over a view
    try:
        size = memoryview(owner).nbytes
    except TypeError:
        return None
    return owner if size == array.nbytes else None


def encode_tensors(
    tensors: dict[str, Tensor], config: WireConfig, *, compress: bool
) -> tuple[list[dict[str, Any]], list[Any]]:
    """The descriptors and data frames of a message's tensors, checked against the limits.

    Raw chunks are memoryviews of the caller's arrays (or, for an array spanning a whole
    buffer, that buffer's own object: see ``_whole_buffer``). ``compress=False``: all raw.
    """
    limits = config.limits
    if len(tensors) > limits.max_tensors:
        raise LimitExceeded(f"{len(tensors)} tensors exceed the limit of {limits.max_tensors}")
    descriptors = []
    buffers: list[Any] = []
    total = 0
    for name, tensor in tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name_chars:
            raise WireError(f"tensor name must be a non-empty str of <= {limits.max_name_chars} chars")
        descriptor, frames, nbytes = _tensor_frames(name, tensor, config, compress)
        total += nbytes
        if nbytes > limits.max_tensor_bytes:
            raise LimitExceeded(f"tensor {name!r} is {nbytes} bytes; the limit is {limits.max_tensor_bytes}")
        descriptors.append(descriptor)
        buffers.extend(frames)
    if total > limits.max_message_bytes:
        raise LimitExceeded(
            f"message carries {total} tensor bytes; the limit is {limits.max_message_bytes} "
            "(stream large payloads instead)"
        )
    return descriptors, buffers


# --- decoding -------------------------------------------------------------------------------


@dataclass(slots=True)
class _Layout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    chunk_bytes: int
    codecs: list[int]
    sizes: list[int]


def _check_descriptor(desc: Any, limits: WireLimits) -> _Layout:
    if not isinstance(desc, dict):
        raise MalformedMessage("tensor descriptor must be a map")
    name, dtype, shape = desc.get("name"), desc.get("dtype"), desc.get("shape")
    if not isinstance(name, str) or not 0 < len(name) <= limits.max_name_chars:
        raise MalformedMessage("tensor name must be a non-empty str of bounded length")
    if not isinstance(dtype, str):
        raise MalformedMessage(f"tensor {name!r}: dtype must be a str")
    try:
        size = itemsize(dtype)
    except KeyError:
        raise MalformedMessage(f"tensor {name!r}: unsupported dtype {dtype[:32]!r}") from None
    if not isinstance(shape, list) or len(shape) > limits.max_ndim:
        raise LimitExceeded(f"tensor {name!r}: shape must be a list of at most {limits.max_ndim} dims")
    if not all(exact_int(d) and 0 <= d <= limits.max_dim for d in shape):
        raise MalformedMessage(f"tensor {name!r}: every dim must be an int in [0, {limits.max_dim}]")
    nbytes = size * math.prod(shape)  # Python ints: no overflow
    if nbytes > limits.max_tensor_bytes:
        raise LimitExceeded(
            f"tensor {name!r} declares {nbytes} bytes; the limit is {limits.max_tensor_bytes}"
        )
    step, chunks = desc.get("chunk_bytes"), desc.get("chunks")
    if not exact_int(step) or not 0 < step <= limits.max_chunk_bytes:
        raise LimitExceeded(f"tensor {name!r}: chunk_bytes must lie in (0, {limits.max_chunk_bytes}]")
    expected_chunks = -(-nbytes // step)
    if chunks != expected_chunks:
        raise MalformedMessage(
            f"tensor {name!r}: {nbytes} bytes in chunks of {step} make {expected_chunks} chunks, "
            f"header says {chunks!r}"
        )
    codecs, sizes = desc.get("codecs"), desc.get("sizes")
    if not isinstance(codecs, list) or not isinstance(sizes, list):
        raise MalformedMessage(f"tensor {name!r}: codecs and sizes must be lists")
    if len(codecs) != chunks or len(sizes) != chunks:
        raise MalformedMessage(f"tensor {name!r}: codecs/sizes must list one entry per chunk")
    for i, (codec, wire) in enumerate(zip(codecs, sizes, strict=True)):
        raw = min(step, nbytes - i * step)
        if codec == CODEC_RAW:
            ok = wire == raw
        elif codec == CODEC_LZ4:
            ok = exact_int(wire) and 0 < wire <= raw  # compressed only when it pays
        else:
            raise MalformedMessage(f"tensor {name!r}: unknown codec {codec!r}")
        if not ok:
            raise MalformedMessage(f"tensor {name!r}: chunk {i} wire size {wire!r} is inconsistent")
    return _Layout(name, dtype, tuple(shape), nbytes, step, codecs, sizes)


def _frame_plan(layout: _Layout) -> list[tuple[int, int, int, int]]:
    """Frames of one tensor as (codec, byte offset, raw bytes, wire bytes); raw runs merge."""
    plan: list[tuple[int, int, int, int]] = []
    for i, (codec, wire) in enumerate(zip(layout.codecs, layout.sizes, strict=True)):
        offset = i * layout.chunk_bytes
        raw = min(layout.chunk_bytes, layout.nbytes - offset)
        if codec == CODEC_RAW and plan and plan[-1][0] == CODEC_RAW:
            c, off, r, w = plan[-1]
            plan[-1] = (c, off, r + raw, w + wire)
        else:
            plan.append((codec, offset, raw, wire))
    return plan


def _materialize(layout: _Layout, plan, frames: Sequence) -> Tensor:
    storage = storage_dtype(layout.dtype)
    if not plan:
        array = np.empty(layout.shape, dtype=storage)
    elif len(plan) == 1 and plan[0][0] == CODEC_RAW:
        array = np.frombuffer(frames[0], dtype=storage).reshape(layout.shape)  # zero-copy
    else:
        flat = np.empty(layout.nbytes, dtype=np.uint8)
        for (codec, offset, raw, _wire), frame in zip(plan, frames, strict=True):
            if codec == CODEC_RAW:
                flat[offset : offset + raw] = np.frombuffer(frame, dtype=np.uint8)
            else:
                try:
                    data = decode_lz4(frame, raw)
                except Exception as exc:
                    raise MalformedMessage(f"tensor {layout.name!r}: bad LZ4 chunk: {exc}") from None
                flat[offset : offset + raw] = np.frombuffer(data, dtype=np.uint8)
        array = flat.view(storage).reshape(layout.shape)
    return TaggedArray(layout.dtype, array) if is_tagged_only(layout.dtype) else array


def decode_tensors(header: dict[str, Any], frames: Sequence, limits: WireLimits) -> dict[str, Tensor]:
    """Check every descriptor against the limits and the frames, then build the tensors."""
    descriptors = header.get("tensors", [])
    if not descriptors and not frames and isinstance(descriptors, list):
        return {}  # the common small message: nothing to check or build
    if not isinstance(descriptors, list):
        raise MalformedMessage("header field 'tensors' must be a list")
    if len(descriptors) > limits.max_tensors:
        raise LimitExceeded(f"{len(descriptors)} tensors exceed the limit of {limits.max_tensors}")
    layouts = [_check_descriptor(d, limits) for d in descriptors]
    if len({layout.name for layout in layouts}) != len(layouts):
        raise MalformedMessage("tensor names must be unique within a message")
    total = sum(layout.nbytes for layout in layouts)
    if total > limits.max_message_bytes:
        raise LimitExceeded(f"message declares {total} bytes; the limit is {limits.max_message_bytes}")
    if sum(len(layout.codecs) for layout in layouts) > limits.max_chunks:
        raise LimitExceeded(f"message declares more than {limits.max_chunks} chunks")
    plans = [_frame_plan(layout) for layout in layouts]
    declared = sum(len(plan) for plan in plans)
    if declared != len(frames):
        raise MalformedMessage(f"header declares {declared} data frames, message has {len(frames)}")
    views = [memoryview(f) for f in frames]
    cursor = 0
    for plan in plans:
        for _codec, _offset, _raw, wire in plan:
            if views[cursor].nbytes != wire:
                raise MalformedMessage(
                    f"data frame {cursor} is {views[cursor].nbytes} bytes, header declares {wire}"
                )
            cursor += 1
    tensors: dict[str, Tensor] = {}
    cursor = 0
    for layout, plan in zip(layouts, plans, strict=True):
        tensors[layout.name] = _materialize(layout, plan, views[cursor : cursor + len(plan)])
        cursor += len(plan)
    return tensors
