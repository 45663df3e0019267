"""The DHT's id space: 160-bit ids for nodes (from their public keys) and keys (from names).

A key is held by the R members whose ids are closest to the key's id by XOR distance. Every
node knows every member, so any node computes any key's replica set locally: one hop.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterable
from typing import Generic, TypeVar

ID_BYTES = 20
ID_BITS = ID_BYTES * 8

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


class Ring(Generic[T]):
    """Members sorted by position, for repeated ``closest`` queries in O(log N) each.

    The members sharing the target's first L bits are one contiguous run of the sorted ring,
    and every one of them is nearer by XOR than any member outside it. The longest such run
    still holding ``count`` members is found by bisection; only it is ranked. The answer is
    exactly ``closest``'s, nearest first (positions are distinct, so distances are too).
    """

    def __init__(self, members: Iterable[tuple[int, T]]):
        ranked = sorted(members, key=lambda member: member[0])
        self._positions = [position for position, _item in ranked]
        self._items = [item for _position, item in ranked]

    def __len__(self) -> int:
        return len(self._positions)

    def _run(self, target: int, shared_bits: int) -> tuple[int, int]:
        shift = ID_BITS - shared_bits
        low = (target >> shift) << shift
        return (
            bisect.bisect_left(self._positions, low),
            bisect.bisect_left(self._positions, low + (1 << shift)),
        )

    def closest(self, target: int, count: int) -> list[T]:
        """The ``count`` members nearest ``target`` by XOR distance, nearest first."""
        shortest, longest = 0, ID_BITS  # the run sharing 0 bits is the whole ring
        while shortest < longest:
            middle = (shortest + longest + 1) // 2
            start, end = self._run(target, middle)
            if end - start >= count:
                shortest = middle
            else:
                longest = middle - 1
        start, end = self._run(target, shortest)
        positions = self._positions
        ranked = sorted(range(start, end), key=lambda index: positions[index] ^ target)
        return [self._items[index] for index in ranked[:count]]
