"""A node's own signed entry under a shared DHT key (announcements, progress reports).

Every entry a role publishes lives the run's ``dht.record_ttl_s``; an owner that keeps one
visible refreshes it at least ``REFRESHES_PER_TTL`` times per lifetime (``check_refresh``),
so it survives two missed refreshes, and a node that dies vanishes within one lifetime.
"""

from __future__ import annotations

from typing import Any

from agora_core import world
from agora_core.dht.node import DhtNode
from agora_core.dht.records import owned_subkey
from agora_core.dht.values import DhtValue
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey

REFRESHES_PER_TTL = 3


def check_refresh(interval_s: float, ttl_s: float, key: str) -> None:
    """ConfigError naming ``key`` unless an entry refreshed every ``interval_s`` is refreshed
    ``REFRESHES_PER_TTL`` times within its lifetime ``ttl_s`` (the run's dht.record_ttl_s)."""
    if interval_s * REFRESHES_PER_TTL > ttl_s:
        raise ConfigError(
            key,
            f"{interval_s:g} s is too long for dht.record_ttl_s = {ttl_s:g} s: refresh at most every "
            f"{ttl_s / REFRESHES_PER_TTL:g} s, so an entry outlives two missed refreshes",
        )


class OwnedEntry:
    """The subkey only ``key``'s holder can write under ``dht_key``: publish, read, withdraw."""

    def __init__(self, dht: DhtNode, key: NodeKey, dht_key: str):
        self.dht = dht
        self.key = key
        self.dht_key = dht_key
        self.subkey = owned_subkey(key.public_key)

    async def publish(self, value: Any, ttl_s: float) -> int:
        """Store ``value`` for ``ttl_s`` seconds; returns how many replicas took it."""
        return await self.dht.store(self.dht_key, self.subkey, value, world.wall() + ttl_s, signer=self.key)

    async def read_all(self) -> dict[str, DhtValue]:
        """Every writer's entry under the key, this one's included."""
        return await self.dht.get(self.dht_key)

    async def withdraw(self) -> int:
        return await self.dht.delete(self.dht_key, self.subkey, signer=self.key)
