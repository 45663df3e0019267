"""The DHT's id space: 160-bit ids for nodes (from their public keys) and keys (from names).

A key is held by the R members whose ids are closest to the key's id by XOR distance. Every
node knows every member, so any node computes any key's replica set locally: one hop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TypeVar

ID_BYTES = 20

T = TypeVar("T")


def key_id(key: str) -> int:
    """The position of a key in the id space."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=ID_BYTES).digest(), "big")


def node_position(node_id: str) -> int:
    """The position of a node (its hex node id) in the id space."""
    return int(node_id, 16)


def closest(target: int, members: Iterable[tuple[int, T]], count: int) -> list[T]:
    """The ``count`` members nearest ``target`` by XOR distance, nearest first."""
    ranked = sorted(members, key=lambda member: member[0] ^ target)
    return [item for _position, item in ranked[:count]]
