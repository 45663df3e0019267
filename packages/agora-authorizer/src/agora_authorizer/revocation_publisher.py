"""Publishing bans in the DHT: the revocation list, in the authorizer's own subkey (and, on
the same beat, forgetting nonces too old to matter).

Bans are written to the database (``agora-authorizer ban``, from any process); this loop
reads the ones recent enough to matter (a banned node's last credential may still be valid
for one lifetime) and republishes the list every third of a DHT record's lifetime, so a ban
reaches every node within one refresh period and the list never lapses. A ban the
authorizer decides itself (:mod:`.accusations`) is published at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from agora_authorizer.store import Store
from agora_core import world
from agora_core.admission.revocations import MAX_ENTRIES, Revocations, revocations_key
from agora_core.config import RunConfig
from agora_core.dht import DhtNode
from agora_core.dht.owned import REFRESHES_PER_TTL, OwnedEntry
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger

log = get_logger("authorizer.revocations")


class RevocationPublisher:
    def __init__(
        self, *, run: RunConfig, key: NodeKey, store: Store, dht: DhtNode, db: Callable[..., Awaitable[Any]]
    ):
        self.store = store
        self.db = db
        self.entry = OwnedEntry(dht, key, revocations_key(run.name))
        self.ttl_s = run.dht.record_ttl_s
        self.period_s = min(self.ttl_s, run.admission.credential_lifetime_s) / REFRESHES_PER_TTL
        # a ban matters while the banned node may still hold an unexpired credential
        self.window_s = run.admission.credential_lifetime_s + run.dht.max_clock_skew_s
        self.nonce_window_s = 2 * run.admission.request_max_age_s + run.dht.max_clock_skew_s
        self.published: Revocations | None = None
        self.on_published: Callable[[Revocations], None] | None = None  # the authorizer's own peers
        # One publish at a time: the list read last is the one stored last (latest expiry wins),
        # when the accusation judge publishes between two beats of this loop.
        self._publishing = asyncio.Lock()

    async def publish(self) -> Revocations:
        async with self._publishing:
            return await self._publish()

    async def _publish(self) -> Revocations:
        now = world.wall()
        nodes, accounts = await self.db(self.store.revoked_since, since=now - self.window_s, now=now)
        if len(nodes) + len(accounts) > MAX_ENTRIES:  # replicas refuse a longer list: keep accounts first
            log.warning("revocations_truncated", nodes=len(nodes), accounts=len(accounts), kept=MAX_ENTRIES)
            accounts = sorted(accounts)[:MAX_ENTRIES]
            nodes = sorted(nodes)[: MAX_ENTRIES - len(accounts)]
        revocations = Revocations(nodes=tuple(sorted(nodes)), accounts=tuple(sorted(accounts)), updated=now)
        await self.entry.publish(revocations.to_value(), self.ttl_s)
        if self.published is None or (self.published.nodes, self.published.accounts) != (
            revocations.nodes,
            revocations.accounts,
        ):
            log.info("revocations_published", nodes=len(nodes), accounts=len(accounts))
        self.published = revocations
        if self.on_published is not None:
            self.on_published(revocations)
        return revocations

    async def run(self) -> None:
        while True:
            try:
                await self.publish()
                # nonces older than a request may be are refused as stale anyway: forget them
                await self.db(self.store.forget_nonces, before=world.wall() - self.nonce_window_s)
            except AgoraError as exc:  # no DHT peer right now: the next period tries again
                log.warning("revocations_publish_failed", error=str(exc))
            await asyncio.sleep(self.period_s)
