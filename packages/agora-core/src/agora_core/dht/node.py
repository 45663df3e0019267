"""A DHT node: SWIM membership plus one-hop replicated storage, served over Agora's RPC.

Every node knows every member, so the R replicas of a key are computed locally and a store
or get goes straight to them, in parallel: one hop, whatever the swarm size. The node owns
the lifecycle, the API and the periodic maintenance; ``gossip`` carries membership and
``replication`` carries records (read merge and repair, handoff, anti-entropy). The node runs
inside the caller's event loop (see ``BlockingDht`` for threads).

In an authorized run (a ``verifier``), members enter the table only with a credential of the
run, and records only from writers the table knows as credentialed members (or the
authorizer). Every record this node writes is signed: by its own key, or the owner's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

from agora_core import world
from agora_core.auth.security import TransportSecurity
from agora_core.config.run import DhtConfig
from agora_core.dht.claims import Claims
from agora_core.dht.directory import check_writer, key_for_address
from agora_core.dht.gossip import Gossip
from agora_core.dht.ids import Ring, key_id
from agora_core.dht.membership import GONE, Member, MemberTable, Status
from agora_core.dht.node_metrics import DhtMetrics
from agora_core.dht.records import DhtError, Record, RecordRejected, make_record
from agora_core.dht.replication import Replication
from agora_core.dht.storage import RecordStore, StoreLimits, Validators
from agora_core.dht.values import DhtValue, visible
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient, RpcConfig, RpcServer
from agora_core.rpc.linkemu import LinkEmulator

if TYPE_CHECKING:
    from agora_core.auth.peer_identity import PeerIdentity
    from agora_core.auth.peers import PeerVerifier

log = get_logger("dht")


class DhtNode:
    def __init__(
        self,
        *,
        key: NodeKey,
        config: DhtConfig | None = None,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        advertise: str | None = None,
        rpc_config: RpcConfig | None = None,
        link: LinkEmulator | None = None,
        metrics: NodeMetrics | None = None,
        validators: Validators | None = None,
        server: RpcServer | None = None,
        client: RpcClient | None = None,
        seed: int | None = None,
        verifier: PeerVerifier | None = None,
        credential: Callable[[], Any] | None = None,
        security: TransportSecurity | None = None,
    ):
        """``verifier``: the run's credential checks (None: an open run, anyone may join);
        ``credential()``: this node's current signed credential value (None in an open run
        and for the authorizer), read whenever the node signs its membership claim.
        ``security``: the authenticated transport of the RPC server and client the node makes
        itself (its verifier is the default ``verifier``; RunNode passes its own server and
        client instead)."""
        if security is not None:  # its checks and its credential, unless told otherwise
            verifier = verifier or security.verifier
            credential = credential or security.credential
        self.key = key
        self.node_id = key.node_id
        self.config = config or DhtConfig()
        self._bootstrap = list(bootstrap)
        self._advertise = advertise
        self._rng = world.rng(seed)
        self.metrics = metrics or NodeMetrics(role="dht", instance=self.node_id[:12])
        self._owns_rpc = server is None
        self.server = server or RpcServer(
            listen=listen,
            config=rpc_config,
            link=link,
            metrics=self.metrics,
            node_id=self.node_id,
            security=security,
        )
        self.client = client or RpcClient(
            config=rpc_config, link=link, metrics=self.metrics, node_id=self.node_id, security=security
        )
        if security is not None and client is None:
            security.add_resolver(self.key_for_address)  # dial members by the keys they claimed
        limits = StoreLimits(
            max_value_bytes=self.config.max_value_bytes,
            max_subkeys=self.config.max_subkeys,
            max_expiration_ahead_s=self.config.max_expiration_ahead_s,
            max_clock_skew_s=self.config.max_clock_skew_s,
        )
        self.verifier = verifier
        self.records = RecordStore(limits, validators, writers=self._check_writer)
        self._member_listeners: list[Callable[[str, bytes], None]] = []
        self.gossip: Gossip | None = None
        self.table: MemberTable | None = None
        self._live_ids: tuple[list, frozenset[str]] = ([], frozenset())  # (the live list, its ids)
        self._alive_cache: Ring[Member] | None = None
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self.address: str | None = None
        self.stats = DhtMetrics(self.metrics)
        self.claims = Claims(
            key=key,
            verifier=verifier,
            credential=credential,
            on_reject=self.stats.rejected,
        )
        if verifier is not None:
            verifier.on_revocations(self._revocations_changed)
        self.replication = Replication(
            node_id=self.node_id,
            records=self.records,
            replicas=self.replicas,
            config=self.config,
            server=self.server,
            client=self.client,
            records_gauge=self.stats.records,
            spawn=self._spawn,
            sender=lambda: self.table.me.to_wire() if self.table else None,
            introduce=lambda update: self.gossip.introduce(update) if self.gossip else None,
        )

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve, join through the bootstrap addresses, and start gossiping. Returns the address."""
        if self._owns_rpc:
            await self.server.start()
        self.address = self._advertise or self.server.address
        # Incarnations start at wall-clock milliseconds: a restarted node outranks its past.
        me = Member(
            self.node_id, self.address, self.key.public_key, world.wall_ns() // 1_000_000, Status.ALIVE
        )
        self.gossip = Gossip(
            me,
            config=self.config,
            server=self.server,
            client=self.client,
            metrics=self.metrics,
            rng=self._rng,
            claims=self.claims,
            on_change=self._membership_changed,
            on_address=self._member_moved,
            on_dead=self._member_died,
        )
        self.table = self.gossip.table
        self.client.on_connection_lost(self.gossip.connection_lost)
        await self.gossip.join(self._bootstrap)
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.gossip.detector.run(), name=f"dht-detector {self.node_id[:8]}"),
            loop.create_task(self.gossip.spread(), name=f"dht-spread {self.node_id[:8]}"),
            loop.create_task(self.gossip.heal(self._bootstrap), name=f"dht-heal {self.node_id[:8]}"),
            loop.create_task(self._maintain(), name=f"dht-maintenance {self.node_id[:8]}"),
        ]
        log.info("dht_started", node=self.node_id[:12], address=self.address, members=len(self.table.live()))
        return self.address

    async def stop(self, *, leave: bool = True) -> None:
        """Stop. With ``leave``, tell a few members first so nobody has to suspect us."""
        if self.gossip is not None and leave and not self.table.leaving:
            await self.gossip.leave()
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._tasks = []
        if self._owns_rpc:
            await self.client.close()
            await self.server.stop()

    async def __aenter__(self) -> DhtNode:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- membership --------------------------------------------------------------------------

    def members(self) -> list[Member]:
        """Live members (alive or suspect), this node included, ordered by id."""
        return self.table.live() if self.table else []

    def identity_of(self, node_id: str) -> PeerIdentity | None:
        """The credential identity of member ``node_id`` as this node's table knows it (None:
        unknown, revoked, or an open run, whose members hold none)."""
        member = self.table.get(node_id) if self.table else None
        return None if member is None or member.revoked else member.identity

    def live_ids(self) -> frozenset[str]:
        """Ids of the live members: entries a crashed node published outlive it by up to their
        TTL, its membership only until its failed probes mark it dead. Worked out once per
        change of the table (its live list is then a new list): every progress tick reads it."""
        live = self.members()
        if live is not self._live_ids[0]:
            self._live_ids = (live, frozenset(m.node_id for m in live))
        return self._live_ids[1]

    def gone(self, node_id: str) -> bool:
        """Whether this node holds ``node_id`` dead or left (its tombstone): calls to it would
        wait out their deadlines. Unknown ids are not gone (nothing is known against them)."""
        member = self.table.get(node_id) if self.table is not None else None
        return member is not None and member.status in GONE

    def left_ids(self) -> set[str]:
        """Ids of the members that announced leaving (their signed LEFT), while their
        tombstones are remembered (``dht.tombstone_s``): a clean stop, told apart from a
        member that vanished (DEAD: its probes failed)."""
        if self.table is None:
            return set()
        return {m.node_id for m in self.table.known() if m.status == Status.LEFT}

    def _membership_changed(self) -> None:
        self._alive_cache = None
        self._changed.set()

    def key_for_address(self, address: str) -> bytes | None:
        """The public key of the member advertising ``address`` (known and not forgotten,
        live ones first, the first to claim it among equals), or None: what the transport
        expects to find at an address."""
        return None if self.table is None else key_for_address(self.table, address)

    def on_member(self, listener: Callable[[str, bytes], None]) -> None:
        """Call ``listener(address, public_key)`` whenever a member enters or changes address."""
        self._member_listeners.append(listener)

    def _member_moved(self, member: Member) -> None:
        for listener in self._member_listeners:
            try:
                listener(member.address, member.public_key)
            except Exception:
                log.exception("dht_member_listener_failed", node=self.node_id[:12])

    def _member_died(self, member: Member) -> None:
        """Unary calls in flight to a member declared dead fail now, not at their deadlines (a
        trainer's hop to a worker that froze or lost its link would wait its whole timeout)."""
        self.client.fail_calls_to(member.address, f"member {member.node_id[:12]} was declared dead")

    def credential_changed(self) -> None:
        """Re-sign this node's claim with its fresh ``credential()`` (raising its
        incarnation) and gossip it, so the others keep it past its old credential's expiry."""
        if self.table is not None:
            self.table.credential_changed()

    def _revocations_changed(self, _revocations: Any) -> None:
        if self.table is not None and self.table.drop(
            lambda m: self.claims.revoked(m.identity), revoked=True
        ):
            log.info("dht_members_revoked", node=self.node_id[:12], dropped=self.table.dropped)

    def _check_writer(self, writer: bytes | None) -> None:
        check_writer(self.table, self.verifier, self.key.public_key, writer)

    # --- replica sets ---------------------------------------------------------------------------

    def replicas(self, key: str) -> list[Member]:
        """The members that hold ``key``: the R alive members closest to its id."""
        if self._alive_cache is None:
            self._alive_cache = Ring((m.position, m) for m in self.table.alive())
        return self._alive_cache.closest(key_id(key), self.config.replication)

    # --- metrics ----------------------------------------------------------------------------------

    @property
    def recent_ops(self) -> collections.deque[tuple[str, float]]:
        """(op, seconds) of the latest operations (status lines, benchmarks)."""
        return self.stats.recent_ops

    @property
    def ops_done(self) -> int:
        return self.stats.ops_done

    def traffic(self) -> tuple[int, int]:
        """(messages, bytes) this node has sent and received, all DHT traffic together."""
        server, client = self.server.traffic, self.client.traffic
        messages = (
            server.messages_sent + server.messages_received + client.messages_sent + client.messages_received
        )
        nbytes = server.bytes_sent + server.bytes_received + client.bytes_sent + client.bytes_received
        return messages, nbytes

    # --- storage: the API -----------------------------------------------------------------------

    async def store(
        self, key: str, subkey: str, value: Any, expiration: float, *, signer: NodeKey | None = None
    ) -> int:
        """Store ``value`` under ``key``/``subkey`` until ``expiration`` (wall-clock seconds).

        Owned subkeys (``owned_subkey(public_key)``) must be signed by their owner: pass its
        key as ``signer``. Returns how many replicas accepted the record; raises
        RecordRejected when replicas refused it, DhtError when none could be reached.
        """
        return await self._put(
            key, subkey, make_record(key, subkey, value, expiration, signer=signer or self.key), "store"
        )

    async def delete(self, key: str, subkey: str, *, signer: NodeKey | None = None) -> int:
        """Hide ``key``/``subkey`` everywhere: a tombstone outranks and outlives every copy."""
        current = (await self._get_records(key)).get(subkey)
        expiration = max(current.expiration if current else 0.0, world.wall()) + 1.0
        record = make_record(key, subkey, None, expiration, signer=signer or self.key, tombstone=True)
        return await self._put(key, subkey, record, "delete")

    async def _put(self, key: str, subkey: str, record: Record, op: str) -> int:
        started = time.perf_counter()
        self.records.validate(key, subkey, record, now=world.wall())  # the replicas' rules, locally first
        try:
            accepted = await self.replication.write(key, subkey, record)
        except RecordRejected:
            self.stats.observe(op, "rejected", started)
            raise
        except DhtError:
            self.stats.observe(op, "unreachable", started)
            raise
        self.stats.observe(op, "ok", started)
        return accepted

    async def _get_records(self, key: str) -> dict[str, Record]:
        return (await self.replication.read([key]))[key]

    async def get(self, key: str) -> dict[str, DhtValue]:
        """All unexpired subkeys of ``key`` (empty if none), newest copy of each."""
        started = time.perf_counter()
        records = await self._get_records(key)
        self.stats.observe("get", "ok", started)
        return visible(records)

    async def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, DhtValue]]:
        """``get`` for many keys at once: one request per replica, all in parallel."""
        started = time.perf_counter()
        records = await self.replication.read(list(dict.fromkeys(keys)))
        self.stats.observe("get_many", "ok", started)
        return {key: visible(subkeys) for key, subkeys in records.items()}

    async def watch(self, key: str, *, interval_s: float = 1.0) -> AsyncIterator[dict[str, DhtValue]]:
        """Yield ``key``'s subkeys now and whenever they change, polling every ``interval_s``.

        Iterate under a deadline of your own (``asyncio.timeout``) or break out when done.
        """
        last = None
        while True:
            current = await self.get(key)
            seen = {subkey: (v.expiration, repr(v.value)) for subkey, v in current.items()}
            if seen != last:
                last = seen
                yield current
            await asyncio.sleep(interval_s)

    # --- maintenance ------------------------------------------------------------------------------

    async def _maintain(self) -> None:
        """Each period: purge, hand records to new replicas after membership changes, and
        every ``sync_periods`` periods run membership and record anti-entropy."""
        period = self.config.gossip_period_s
        tick = 0
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(period):  # not wait_for: in 3.11 it can eat a cancel
                    await self._changed.wait()
            changed = self._changed.is_set()
            self._changed.clear()
            tick += 1
            try:
                self.records.purge(world.wall())
                if changed and await self.replication.handoff():
                    self._changed.set()  # some records were not delivered: hand them over again
                if tick % self.config.sync_periods == 0:
                    await self.gossip.sync()
                    await self.replication.anti_entropy()
                self.stats.update(self.table, len(self.records))
            except Exception:  # maintenance must outlive any one bad round
                log.exception("dht_maintenance_failed", node=self.node_id[:12])
            if changed:  # at most one handoff per period, however fast the news comes
                await asyncio.sleep(period)
