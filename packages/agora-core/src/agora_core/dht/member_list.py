"""Member lists (joins, syncs, ``dht.members``) travel as one tensor of msgpack bytes, not in
the header: a credentialed member's update is some 450 bytes, and a header holds 64 KiB, so
a list of a few hundred members would not fit there. A data frame carries it at any run size,
bounded here before it is unpacked."""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from agora_core.dht import bulk

TENSOR = "members"
MAX_LIST_BYTES = 16 << 20  # about 35 000 credentialed members
MAX_LISTED = 1 << 16


def pack(entries: list[list]) -> dict[str, np.ndarray]:
    """The tensors of a payload carrying ``entries`` (member updates in their wire form)."""
    return {TENSOR: np.frombuffer(msgpack.packb(entries, use_bin_type=True), dtype=np.uint8)}


def unpack(meta: Any, tensors: dict[str, Any]) -> list | None:
    """The member list a payload carries (its tensor, or a short list in ``meta["members"]``);
    None when there is none or it is malformed or too large."""
    data = tensors.get(TENSOR) if isinstance(tensors, dict) else None
    if data is None:
        listed = meta.get("members") if isinstance(meta, dict) else None
        return listed if isinstance(listed, list) else None
    entries = bulk.unpack_packed(data, max_bytes=MAX_LIST_BYTES, max_entries=MAX_LISTED, max_map_entries=16)
    return entries if isinstance(entries, list) else None
