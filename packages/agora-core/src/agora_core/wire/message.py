"""Agora wire format: multipart ``[header, *buffers]`` with a msgpack header.

The format is specified in the agora-core README ("Wire format"); this module is its reference
implementation for the message and its header, :mod:`agora_core.wire.tensor_frames` for the tensors'
descriptors and data frames. Decoding is strict and bounded: the header frame's length is
checked before msgpack sees it, the header's schema and every declared size are checked against
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

from agora_core.errors import LimitExceeded, MalformedMessage, UnsupportedProtocolVersion, WireError
from agora_core.wire.codec import CompressionPolicy
from agora_core.wire.dtypes import Tensor
from agora_core.wire.tensor_frames import decode_tensors, encode_tensors, exact_int

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


def encode(message: Message, config: WireConfig) -> list[Any]:
    """Encode to ``[header, *buffers]``; the buffers are ``encode_tensors``' data frames (raw
    chunks are not copied: see :mod:`agora_core.wire.tensor_frames`)."""
    limits = config.limits
    if message.tensors:
        descriptors, buffers = encode_tensors(message.tensors, config, compress=message.compress)
    else:
        descriptors, buffers = [], []  # the common small message
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
    return rid if exact_int(rid) and 0 <= rid < 1 << 63 else None


def check_header(header: dict[str, Any], limits: WireLimits) -> Message:
    """Validate the header's schema and limits; return a Message without tensors yet."""
    # type(x) is int, not a helper call: this runs for every message (and bool is no int here)
    version = header.get("v")
    if (
        type(version) is not list
        or len(version) != 2
        or type(version[0]) is not int
        or type(version[1]) is not int
    ):
        raise MalformedMessage("header field 'v' must be [major, minor]")
    if version[0] != PROTOCOL_VERSION[0]:
        raise UnsupportedProtocolVersion(
            f"peer speaks protocol {version[0]}.{version[1]}; this node speaks {PROTOCOL_VERSION[0]}.x"
        )
    kind = header.get("kind")
    kind = _KINDS.get(kind) if type(kind) is int else None
    if kind is None:
        raise MalformedMessage(f"unknown message kind {header.get('kind')!r}")
    method = header.get("method", "")
    if not isinstance(method, str) or len(method) > limits.max_name_chars:
        raise MalformedMessage("header field 'method' must be a str of bounded length")
    rid = header.get("id")
    if type(rid) is not int or not 0 <= rid < 1 << 63:
        raise MalformedMessage("header field 'id' must be a non-negative 63-bit int")
    deadline = header.get("deadline_s")
    if deadline is not None and (type(deadline) not in (int, float) or math.isnan(deadline)):
        raise MalformedMessage("header field 'deadline_s' must be a number or nil")
    sender = header.get("sender", "")
    if not isinstance(sender, str) or len(sender) > limits.max_name_chars:
        raise MalformedMessage("header field 'sender' must be a str of bounded length")
    end = header.get("end", False)
    credit = header.get("credit", 0)
    if type(end) is not bool or type(credit) is not int or not 0 <= credit <= 1 << 20:
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


def decode(frames: Sequence, limits: WireLimits) -> Message:
    """Decode a whole multipart message; raises a WireError subclass on any inconsistency."""
    if not frames:
        raise MalformedMessage("empty multipart message")
    header = unpack_header(frames[0], limits)
    message = check_header(header, limits)
    message.tensors = decode_tensors(header, frames[1:], limits)
    return message
