"""Large DHT payload fields (records of a store or a get, anti-entropy digests) travel as one
tensor of msgpack bytes instead of in the header. A header holds 64 KiB; a stage of a thousand
workers announces a few hundred KiB under one key, and a replica's digest of its keys can be
larger still. Small fields stay in the header, where they cost nothing extra.

The tensor's bytes are unpacked with bounds: no more entries than the DHT's calls allow.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

INLINE_BYTES = 16 << 10  # fields packed to at most this stay in the header
MAX_BULK_BYTES = 64 << 20
MAX_ENTRIES = 1 << 20  # per array or map inside a bulk field


def tensor_name(field: str) -> str:
    return f"bulk.{field}"


def pack(field: str, value: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(meta fields, tensors)`` carrying ``value`` as ``field``: in the header when small."""
    packed = msgpack.packb(value, use_bin_type=True)
    if len(packed) <= INLINE_BYTES:
        return {field: value}, {}
    return {}, {tensor_name(field): np.frombuffer(packed, dtype=np.uint8)}


def unpack(field: str, meta: Any, tensors: Any, default: Any = None) -> Any:
    """The value of ``field`` a payload carries (in its tensor or its header); ``default`` when
    absent, malformed or too large."""
    data = tensors.get(tensor_name(field)) if isinstance(tensors, dict) else None
    if data is None:
        return meta.get(field, default) if isinstance(meta, dict) else default
    value = unpack_tensor(
        data, max_bytes=MAX_BULK_BYTES, max_entries=MAX_ENTRIES, max_map_entries=MAX_ENTRIES
    )
    return default if value is None else value


def unpack_tensor(data: Any, *, max_bytes: int, max_entries: int, max_map_entries: int) -> Any:
    """The msgpack value in a uint8 tensor, unpacked within bounds; None if it is not one."""
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 1
        or data.nbytes > max_bytes
    ):
        return None
    try:
        return msgpack.unpackb(
            data.tobytes(),
            raw=False,
            max_array_len=max_entries,
            max_map_len=max_map_entries,
            strict_map_key=True,
        )
    except (ValueError, msgpack.UnpackException, TypeError):
        return None
