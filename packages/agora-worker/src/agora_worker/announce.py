"""Visibility: the worker announces itself under its stage, refreshed well within its expiry.

The announcement lives the run's ``dht.record_ttl_s`` and is refreshed every
``announce_interval_s`` (at most a third of it). Trainers route only to workers they can see,
so a worker that dies simply stops refreshing and vanishes from the stage within one
``record_ttl_s``; until then a trainer whose call to it fails bans it. A worker that stops
cleanly withdraws at once, and a worker that stops serving (self-termination)
retires: withdraws for good. In an authorized run nothing is announced before the worker
holds a valid credential (``allowed``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agora_core import world
from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import OwnedEntry, check_refresh
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.schema import WorkerAnnouncement, stage_workers_key

log = get_logger("worker.announce")


class Announcer:
    def __init__(
        self,
        *,
        dht: DhtNode,
        key: NodeKey,
        run_name: str,
        stage: int,
        interval_s: float,
        ttl_s: float,
        describe: Callable[[], WorkerAnnouncement],
        allowed: Callable[[], bool] = lambda: True,
    ):
        """``ttl_s``: the run's dht.record_ttl_s; ``interval_s`` must be at most a third of it;
        ``allowed()``: whether the worker may be seen now (admitted, its credential valid)."""
        check_refresh(interval_s, ttl_s, "announce_interval_s")
        self._entry = OwnedEntry(dht, key, stage_workers_key(run_name, stage))
        self._interval_s = interval_s
        self._describe = describe
        self._allowed = allowed
        self.ttl_s = ttl_s
        self.last_ok = world.monotonic()  # when an announcement last reached the DHT
        self.retired = False
        self._lock = asyncio.Lock()  # no announcement in flight while it retires

    async def announce(self) -> None:
        async with self._lock:
            if self.retired or not self._allowed():
                return
            await self._entry.publish(self._describe().to_value(), self.ttl_s)
            self.last_ok = world.monotonic()

    async def run(self) -> None:
        while True:
            try:
                await self.announce()
            except (DhtError, RpcError) as exc:
                log.warning("announce_failed", error=str(exc))
            await asyncio.sleep(self._interval_s)

    async def retire(self) -> None:
        """Withdraw now and never announce again: trainers stop routing here at once."""
        async with self._lock:
            self.retired = True
            await self.withdraw()

    async def withdraw(self) -> None:
        """Remove the announcement now (a clean shutdown)."""
        try:
            await self._entry.withdraw()
        except (DhtError, RpcError) as exc:
            log.warning("withdraw_failed", error=str(exc))
