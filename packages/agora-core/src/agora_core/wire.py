"""Agora wire format: multipart ``[header, *buffers]`` with a msgpack header.

The format is specified in the agora-core README ("Wire format"); this module is its reference
implementation. Decoding is strict and bounded: the header frame's length is checked before
msgpack sees it, the header's schema and every declared size are checked against
:class:`WireLimits` before a byte of tensor memory is allocated, and the frames must match the
header exactly. Anything else raises :class:`MalformedMessage`, :class:`LimitExceeded` or
:class:`UnsupportedProtocolVersion`.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from agora_core.codec import CODEC_LZ4, CODEC_RAW, CompressionPolicy, decode_lz4, encode_chunk
from agora_core.dtypes import (
    TaggedArray,
    Tensor,
    as_wire_array,
    is_tagged_only,
    itemsize,
    storage_dtype,
)
from agora_core.errors import LimitExceeded, MalformedMessage, UnsupportedProtocolVersion, WireError

# (major, minor): a different major is refused, minors interoperate. 2: stream items and ends
# may carry credit (a 1.x peer would ignore it and stall).
PROTOCOL_VERSION = (2, 0)
MiB = 1 << 20


class Kind(enum.IntEnum):
    REQUEST = 1  # opens a call (unary or streaming)
    RESPONSE = 2  # final successful reply; ends the call
    ERROR = 3  # final failed reply; ends the call
    STREAM = 4  # one item of a stream, either direction
    CREDIT = 5  # flow control: the receiver grants ``credit`` more stream items
    CANCEL = 6  # the caller abandons the call


_KINDS = {int(kind): kind for kind in Kind}  # a dict lookup is far cheaper than Kind(value)


@dataclass(kw_only=True, frozen=True)
class WireLimits:
    """Upper bounds a receiver enforces before decoding or allocating anything."""

    max_header_bytes: int = 64 * 1024
    max_tensors: int = 64  # tensors per message
    max_ndim: int = 8
    max_dim: int = 1 << 40  # any single dimension
    max_name_chars: int = 128  # tensor and method names
    max_tensor_bytes: int = 1 << 30  # decoded size of one tensor
    max_message_bytes: int = 512 * MiB  # decoded size of all tensors of one message
    max_chunk_bytes: int = 64 * MiB  # a sender's declared chunk size
    max_chunks: int = 4096  # chunks per message, all tensors together

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) <= 0:
                raise ValueError(f"WireLimits.{name} must be positive")

    @property
    def max_frame_bytes(self) -> int:
        """Largest single frame a valid message can carry (used for ZMQ_MAXMSGSIZE)."""
        return max(self.max_message_bytes, self.max_header_bytes)


@dataclass(kw_only=True, frozen=True)
class WireConfig:
    chunk_bytes: int = 2 * MiB  # tensors are cut into chunks of this size for codec choice
    compression: CompressionPolicy = field(default_factory=CompressionPolicy)
    limits: WireLimits = field(default_factory=WireLimits)

    def __post_init__(self) -> None:
        if not 0 < self.chunk_bytes <= self.limits.max_chunk_bytes:
            raise ValueError(
                f"chunk_bytes must lie in (0, {self.limits.max_chunk_bytes}], got {self.chunk_bytes}"
            )


@dataclass(slots=True)
class Message:
    """One decoded (or to-be-encoded) message. ``meta`` is any msgpack-able value."""

    kind: Kind
    method: str = ""
    request_id: int = 0
    deadline_s: float | None = None  # seconds left for the call when the message was sent
    sender: str = ""
    meta: Any = None
    tensors: dict[str, Tensor] = field(default_factory=dict)
    end: bool = False  # STREAM: last item from this side
    credit: int = 0  # CREDIT: items granted
    error_code: str = ""  # ERROR
    error_message: str = ""  # ERROR
    compress: bool = True  # False: every chunk travels raw, whatever the compression policy says


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


def encode(message: Message, config: WireConfig) -> list[Any]:
    """Encode to ``[header, *buffers]``; raw chunks are memoryviews of the caller's arrays (or,
    for an array spanning a whole buffer, that buffer's own object: see ``_whole_buffer``)."""
    limits = config.limits
    if len(message.tensors) > limits.max_tensors:
        raise LimitExceeded(f"{len(message.tensors)} tensors exceed the limit of {limits.max_tensors}")
    descriptors = []
    buffers: list[Any] = []
    total = 0
    for name, tensor in message.tensors.items():
        if not isinstance(name, str) or not 0 < len(name) <= limits.max_name_chars:
            raise WireError(f"tensor name must be a non-empty str of <= {limits.max_name_chars} chars")
        descriptor, frames, nbytes = _tensor_frames(name, tensor, config, message.compress)
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
    header: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "kind": int(message.kind),
        "method": message.method,
        "id": message.request_id,
        "deadline_s": message.deadline_s,
        "sender": message.sender,
        "meta": message.meta,
        "tensors": descriptors,
    }
    if message.end:
        header["end"] = True
    if message.credit:
        header["credit"] = message.credit
    if message.kind == Kind.ERROR:
        header["error"] = {"code": message.error_code, "message": message.error_message}
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireError(f"message metadata is not msgpack-serializable: {exc}") from exc
    if len(packed) > limits.max_header_bytes:
        raise LimitExceeded(
            f"header is {len(packed)} bytes; the limit is {limits.max_header_bytes} "
            "(move bulk data into tensors)"
        )
    return [packed, *buffers]


# --- decoding -------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return type(value) is int  # msgpack decodes integers to exactly int; bool is not one here


def unpack_header(frame, limits: WireLimits) -> dict[str, Any]:
    """Bounded msgpack decode of the header frame into a dict (schema not yet checked)."""
    size = len(memoryview(frame))
    if size > limits.max_header_bytes:
        raise LimitExceeded(f"header frame is {size} bytes; the limit is {limits.max_header_bytes}")
    try:
        header = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise MalformedMessage(f"header is not valid msgpack: {type(exc).__name__}") from None
    if not isinstance(header, dict):
        raise MalformedMessage(f"header must be a map, got {type(header).__name__}")
    return header


def peek_request_id(header: dict[str, Any]) -> int | None:
    """The request id of a header that failed validation, if it has a usable one."""
    rid = header.get("id")
    return rid if _is_int(rid) and 0 <= rid < 1 << 63 else None


def check_header(header: dict[str, Any], limits: WireLimits) -> Message:
    """Validate the header's schema and limits; return a Message without tensors yet."""
    version = header.get("v")
    if type(version) is not list or len(version) != 2 or not (_is_int(version[0]) and _is_int(version[1])):
        raise MalformedMessage("header field 'v' must be [major, minor]")
    if version[0] != PROTOCOL_VERSION[0]:
        raise UnsupportedProtocolVersion(
            f"peer speaks protocol {version[0]}.{version[1]}; this node speaks {PROTOCOL_VERSION[0]}.x"
        )
    kind = _KINDS.get(header.get("kind")) if _is_int(header.get("kind")) else None
    if kind is None:
        raise MalformedMessage(f"unknown message kind {header.get('kind')!r}")
    method = header.get("method", "")
    if not isinstance(method, str) or len(method) > limits.max_name_chars:
        raise MalformedMessage("header field 'method' must be a str of bounded length")
    rid = peek_request_id(header)
    if rid is None:
        raise MalformedMessage("header field 'id' must be a non-negative 63-bit int")
    deadline = header.get("deadline_s")
    if deadline is not None and (
        not isinstance(deadline, (int, float)) or isinstance(deadline, bool) or math.isnan(deadline)
    ):
        raise MalformedMessage("header field 'deadline_s' must be a number or nil")
    sender = header.get("sender", "")
    if not isinstance(sender, str) or len(sender) > limits.max_name_chars:
        raise MalformedMessage("header field 'sender' must be a str of bounded length")
    end = header.get("end", False)
    credit = header.get("credit", 0)
    if not isinstance(end, bool) or not _is_int(credit) or not 0 <= credit <= 1 << 20:
        raise MalformedMessage("header fields 'end'/'credit' have wrong types or range")
    message = Message(
        kind=kind,
        method=method,
        request_id=rid,
        deadline_s=float(deadline) if deadline is not None else None,
        sender=sender,
        meta=header.get("meta"),
        end=end,
        credit=credit,
    )
    if message.kind == Kind.ERROR:
        error = header.get("error")
        if (
            not isinstance(error, dict)
            or not isinstance(error.get("code"), str)
            or not isinstance(error.get("message"), str)
        ):
            raise MalformedMessage("error reply lacks {'code': str, 'message': str}")
        message.error_code, message.error_message = error["code"], error["message"]
    return message


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
    if not all(_is_int(d) and 0 <= d <= limits.max_dim for d in shape):
        raise MalformedMessage(f"tensor {name!r}: every dim must be an int in [0, {limits.max_dim}]")
    nbytes = size * math.prod(shape)  # Python ints: no overflow
    if nbytes > limits.max_tensor_bytes:
        raise LimitExceeded(
            f"tensor {name!r} declares {nbytes} bytes; the limit is {limits.max_tensor_bytes}"
        )
    step, chunks = desc.get("chunk_bytes"), desc.get("chunks")
    if not _is_int(step) or not 0 < step <= limits.max_chunk_bytes:
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
            ok = _is_int(wire) and 0 < wire <= raw  # compressed only when it pays
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


def decode(frames: Sequence, limits: WireLimits) -> Message:
    """Decode a whole multipart message; raises a WireError subclass on any inconsistency."""
    if not frames:
        raise MalformedMessage("empty multipart message")
    header = unpack_header(frames[0], limits)
    message = check_header(header, limits)
    message.tensors = decode_tensors(header, frames[1:], limits)
    return message
