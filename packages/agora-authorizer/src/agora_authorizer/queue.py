"""The admission queue: checked requests wait here in arrival order for the token bucket.

The database is the queue (requests with status "queued", in id order: the order they
arrived in); this class mirrors it in memory and releases its head whenever the bucket has a
token. Checks take longer for some joiners than for others, so a request that arrived
earlier may finish its checks later: the head is held back while an earlier request is
still being checked (for at most ``hold_s``), so nodes are admitted in the order they asked.
One releaser at a time. A restarted authorizer rebuilds the mirror from the database and
carries on where it stopped.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections.abc import Awaitable, Callable

from agora_authorizer.bucket import TokenBucket
from agora_core import world
from agora_core.observability.logs import get_logger

log = get_logger("authorizer.queue")


class AdmissionQueue:
    def __init__(self, bucket: TokenBucket, admit: Callable[[int], Awaitable[None]], *, hold_s: float = 30.0):
        self.bucket = bucket
        self.admit = admit  # issues request id's credential and records it as admitted
        self.hold_s = hold_s
        self._ids: list[int] = []  # sorted: arrival order
        self._checking: dict[int, float] = {}  # request id -> when its checks began (monotonic)
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._ids)

    def load(self, request_ids: list[int]) -> None:
        self._ids = sorted(request_ids)

    def checking(self, request_id: int) -> None:
        """Request ``request_id`` arrived and is being checked: later ones wait for it."""
        self._checking[request_id] = world.monotonic()

    def checked(self, request_id: int) -> None:
        """Its checks ended (queued, or refused)."""
        self._checking.pop(request_id, None)
        self._wake.set()

    def add(self, request_id: int) -> None:
        bisect.insort(self._ids, request_id)
        self.checked(request_id)

    def position(self, request_id: int) -> int | None:
        """1 for the head; None when it is not queued."""
        index = bisect.bisect_left(self._ids, request_id)
        return index + 1 if index < len(self._ids) and self._ids[index] == request_id else None

    def _head_ready(self) -> bool:
        """The head may go: no earlier request is still being checked (within hold_s)."""
        now = world.monotonic()
        head = self._ids[0]
        return not any(rid < head and now - began < self.hold_s for rid, began in self._checking.items())

    def eta_s(self, position: int) -> float:
        """Seconds until the node at ``position`` is released, at the bucket's rate."""
        if self.bucket.unlimited:
            return 0.0
        return self.bucket.wait_s(float(position))

    async def admit_at_once(self, request_id: int) -> bool:
        """Admit a request whose checks just passed without queueing it, if it would be
        released at once anyway: nothing queued, no earlier request being checked, a token
        in the bucket. False (nothing done) otherwise: then it is queued."""
        async with self._lock:
            earlier = any(rid < request_id for rid in self._checking)
            if self._ids or earlier or not self.bucket.take():
                return False
            await self.admit(request_id)
            return True

    async def release_ready(self) -> int:
        """Admit from the head while the bucket has tokens; how many were admitted."""
        admitted = 0
        async with self._lock:
            while self._ids and self._head_ready() and self.bucket.take():
                request_id = self._ids[0]
                try:
                    await self.admit(request_id)
                except Exception:
                    # the token is spent, the node stays at the head: the database or the
                    # signer failed, and the next pass tries it again
                    log.exception("admit_failed", request_id=request_id)
                    raise
                self._ids.pop(0)
                admitted += 1
        return admitted

    async def run(self, *, retry_s: float = 1.0) -> None:
        """Release the queue as tokens come, until cancelled."""
        while True:
            if not self._ids or not self._head_ready():
                self._wake.clear()  # an arrival or a finished check wakes it
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.hold_s):
                        await self._wake.wait()
            try:
                await self.release_ready()
            except Exception:  # logged above; back off, then try the same head again
                await asyncio.sleep(retry_s)
                continue
            if self._ids and self._head_ready():
                await asyncio.sleep(max(0.01, self.bucket.wait_s()))  # the bucket's next token
