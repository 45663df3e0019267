"""Large DHT payload fields (records of a store or a get, anti-entropy digests) travel as one
tensor of msgpack bytes instead of in the header. A header holds 64 KiB; a stage of a thousand
workers announces a few hundred KiB under one key, and a replica's digest of its keys can be
larger still.

A field is packed once, whatever its size: small, its bytes ride in the header as one binary
field (copied, not packed again); large, they are a data frame. Either way the receiver
unpacks them once, with bounds: no more entries than the DHT's calls allow.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

INLINE_BYTES = 16 << 10  # fields packed to at most this ride in the header
MAX_BULK_BYTES = 64 << 20
MAX_ENTRIES = 1 << 20  # per array or map inside a bulk field


def bulk_name(field: str) -> str:
    """The header field or tensor that carries ``field`` packed."""
    return f"bulk.{field}"


def pack(field: str, value: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta fields, tensors)`` carrying ``value`` as ``field``."""
    packed = msgpack.packb(value, use_bin_type=True)
    if len(packed) <= INLINE_BYTES:
        return {bulk_name(field): packed}, {}
    return {}, {bulk_name(field): np.frombuffer(packed, dtype=np.uint8)}


def unpack(field: str, meta: Any, tensors: Any, default: Any = None) -> Any:
    """The value of ``field`` a payload carries (packed in its tensor or header, or plainly in
    the header from a hand-written call); ``default`` when absent, malformed or too large."""
    name = bulk_name(field)
    data = tensors.get(name) if isinstance(tensors, dict) else None
    if data is None and isinstance(meta, dict):
        data = meta.get(name)
        if data is None:
            return meta.get(field, default)
    if data is None:
        return default
    value = unpack_packed(
        data, max_bytes=MAX_BULK_BYTES, max_entries=MAX_ENTRIES, max_map_entries=MAX_ENTRIES
    )
    return default if value is None else value


def unpack_packed(data: Any, *, max_bytes: int, max_entries: int, max_map_entries: int) -> Any:
    """The msgpack value in ``data`` (bytes, or a 1-d uint8 tensor), unpacked within bounds;
    None if it is not one."""
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim != 1 or data.nbytes > max_bytes:
            return None  # judged before copying it out
        data = data.tobytes()
    if not isinstance(data, bytes) or len(data) > max_bytes:
        return None
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            max_array_len=max_entries,
            max_map_len=max_map_entries,
            strict_map_key=True,
        )
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
