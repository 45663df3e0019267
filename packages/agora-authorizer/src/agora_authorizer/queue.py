"""The admission queue: checked requests wait here in arrival order for the token bucket.

The database is the queue (requests with status "queued", in id order); this class mirrors
it in memory and releases its head whenever the bucket has a token. One releaser at a time,
so nodes are admitted strictly in arrival order. A restarted authorizer rebuilds the mirror
from the database and carries on where it stopped.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from agora_authorizer.bucket import TokenBucket
from agora_core.logs import get_logger

log = get_logger("authorizer.queue")


class AdmissionQueue:
    def __init__(self, bucket: TokenBucket, admit: Callable[[int], Awaitable[None]]):
        self.bucket = bucket
        self.admit = admit  # issues request id's credential and records it as admitted
        self._ids: deque[int] = deque()
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()

    def __len__(self) -> int:
        return len(self._ids)

    def load(self, request_ids: list[int]) -> None:
        self._ids = deque(sorted(request_ids))

    def add(self, request_id: int) -> None:
        self._ids.append(request_id)
        self._wake.set()

    def position(self, request_id: int) -> int | None:
        """1 for the head; None when it is not queued."""
        try:
            return self._ids.index(request_id) + 1
        except ValueError:
            return None

    def eta_s(self, position: int) -> float:
        """Seconds until the node at ``position`` is released, at the bucket's rate."""
        if self.bucket.unlimited:
            return 0.0
        return self.bucket.wait_s(float(position))

    async def release_ready(self) -> int:
        """Admit from the head while the bucket has tokens; how many were admitted."""
        admitted = 0
        async with self._lock:
            while self._ids and self.bucket.take():
                request_id = self._ids[0]
                try:
                    await self.admit(request_id)
                except Exception:
                    # the token is spent, the node stays at the head: the database or the
                    # signer failed, and the next pass tries it again
                    log.exception("admit_failed", request_id=request_id)
                    raise
                self._ids.popleft()
                admitted += 1
        return admitted

    async def run(self, *, retry_s: float = 1.0) -> None:
        """Release the queue as tokens come, until cancelled."""
        while True:
            if not self._ids:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self.release_ready()
            except Exception:  # logged above; back off, then try the same head again
                await asyncio.sleep(retry_s)
                continue
            if self._ids:
                await asyncio.sleep(max(0.01, self.bucket.wait_s()))  # the bucket's next token
