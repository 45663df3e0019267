"""Call deadlines in buckets of 10 ms, one loop timer per bucket instead of one per call.

A timer per call costs more than a small call's own bookkeeping (create, push onto the loop's
heap, cancel; about 4 us in all), and nearly every one is cancelled. Here a call joins the
bucket its deadline falls in; when the bucket's one timer fires, the calls in it that are
still waiting fail. A deadline so fires up to one bucket late, never early. Entries name a
call by its pending-calls map and request id, so a finished call's reply is not kept alive.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

BUCKET_S = 0.01


class DeadlineBuckets:
    def __init__(self, expire: Callable[[asyncio.Future], None], bucket_s: float = BUCKET_S):
        self._expire = expire
        self._bucket_s = bucket_s
        self._buckets: dict[int, list[tuple[dict, int]]] = {}

    def add(self, deadline: float, pending: dict[int, asyncio.Future], rid: int) -> None:
        """Expire ``pending[rid]`` at ``deadline`` (``loop.time()``) if it is still there."""
        slot = math.ceil(deadline / self._bucket_s)
        bucket = self._buckets.get(slot)
        if bucket is None:
            bucket = self._buckets[slot] = []
            asyncio.get_running_loop().call_at(slot * self._bucket_s, self._fire, slot)
        bucket.append((pending, rid))

    def _fire(self, slot: int) -> None:
        for pending, rid in self._buckets.pop(slot, ()):
            future = pending.get(rid)
            if future is not None and not future.done():
                self._expire(future)
