"""Visibility: the worker announces itself under its stage, refreshed well within its expiry.

The announcement lives the run's ``dht.record_ttl_s`` and is refreshed every
``announce_interval_s`` (at most a third of it). Trainers route only to workers they can see,
so a worker that dies simply stops refreshing and vanishes from the stage within one
``record_ttl_s``; until then a trainer whose call to it fails bans it. A worker that stops
cleanly withdraws at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import OwnedEntry, check_refresh
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.logs import get_logger
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
    ):
        """``ttl_s``: the run's dht.record_ttl_s; ``interval_s`` must be at most a third of it."""
        check_refresh(interval_s, ttl_s, "announce_interval_s")
        self._entry = OwnedEntry(dht, key, stage_workers_key(run_name, stage))
        self._interval_s = interval_s
        self._describe = describe
        self.ttl_s = ttl_s

    async def announce(self) -> None:
        await self._entry.publish(self._describe().to_value(), self.ttl_s)

    async def run(self) -> None:
        while True:
            try:
                await self.announce()
            except (DhtError, RpcError) as exc:
                log.warning("announce_failed", error=str(exc))
            await asyncio.sleep(self._interval_s)

    async def withdraw(self) -> None:
        """Remove the announcement now (a clean shutdown)."""
        try:
            await self._entry.withdraw()
        except (DhtError, RpcError) as exc:
            log.warning("withdraw_failed", error=str(exc))
