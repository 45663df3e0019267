"""Visibility: the worker announces itself under its stage, refreshed with a short expiry.

Trainers route only to workers they can see, so a worker that dies simply stops refreshing
and vanishes from the stage within one expiry; a worker that stops cleanly withdraws at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from agora_core.dht import DhtError, DhtNode, owned_subkey
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
        run: str,
        stage: int,
        interval_s: float,
        describe: Callable[[], WorkerAnnouncement],
    ):
        self._dht = dht
        self._key = key
        self._dht_key = stage_workers_key(run, stage)
        self._subkey = owned_subkey(key.public_key)
        self._interval_s = interval_s
        self._describe = describe
        self.ttl_s = 3 * interval_s  # gone within three missed refreshes

    async def announce(self) -> None:
        value = self._describe().to_value()
        await self._dht.store(self._dht_key, self._subkey, value, time.time() + self.ttl_s, signer=self._key)

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
            await self._dht.delete(self._dht_key, self._subkey, signer=self._key)
        except (DhtError, RpcError) as exc:
            log.warning("withdraw_failed", error=str(exc))
