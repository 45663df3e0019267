"""Record traffic of a DHT node: how a record reaches its R replicas and stays on them.

This is the glue between the record store and the RPC layer, as ``gossip`` is for membership:
the ``dht.store``, ``dht.get`` and ``dht.digest`` methods a replica serves, and the calls that
reach them on other nodes. Writes go to every replica in parallel. Reads ask a majority of
the replicas, hedging to the others when one is slow or fails (``reads``), merge newest-wins
(counting only copies that pass the store rules) and repair replicas that answered without
the winner, late answers included. When membership changes, a node hands the records it holds to
their new replicas; every few periods, digest anti-entropy sends replicas what they lack.
Every path ends in the same checks (``RecordStore.validate``: the writer's signature above
all). A store request carries its sender's own membership claim, so a replica that has not
heard of a node that just joined learns it before judging the records it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from agora_core import world
from agora_core.config.run import DhtConfig
from agora_core.contract import Method
from agora_core.dht import bulk
from agora_core.dht.membership import Member
from agora_core.dht.reads import HedgeDelay, QuorumRead
from agora_core.dht.records import DhtError, Record, RecordRejected
from agora_core.dht.storage import RecordStore, newer
from agora_core.errors import BadRequest, RpcError
from agora_core.rpc import Payload, Request, RpcClient, RpcServer

MAX_KEYS_PER_CALL = 1024

Item = tuple[str, str, Record]  # (key, subkey, record)


class Replication:
    def __init__(
        self,
        *,
        node_id: str,
        records: RecordStore,
        replicas: Callable[[str], list[Member]],
        config: DhtConfig,
        server: RpcServer,
        client: RpcClient,
        records_gauge: Any,
        spawn: Callable[[Coroutine], None],
        sender: Callable[[], Any] = lambda: None,
        introduce: Callable[[Any], None] = lambda update: None,
    ):
        """``replicas(key)``: the members that hold ``key`` now; ``records_gauge``: set to the
        number of records held whenever a store changes it; ``spawn``: runs a background task
        the node cancels when it stops (read repair); ``sender()``: this node's membership
        update, sent with every store; ``introduce(update)``: merge a store's sender."""
        self.node_id = node_id
        self.records = records
        self.replicas = replicas
        self.config = config
        self.client = client
        self._records_gauge = records_gauge
        self._spawn = spawn
        self._sender = sender
        self._introduce = introduce
        self._replica_memo: dict[str, frozenset[str]] = {}  # key -> replicas it was last handed to
        # Reads ask more replicas than a quorum only after this long (``reads``); the floor
        # keeps scheduling jitter on a fast link from doubling the requests.
        self._hedge = HedgeDelay(floor_s=0.005, ceiling_s=config.op_timeout_s / 5)
        self._rng = world.rng()
        # plain functions where the answer is at hand: the server runs them on its receive
        # path, without a task per request
        for method, handler in (
            (Method.DHT_STORE, self._on_store),
            (Method.DHT_GET, self._on_get),
            (Method.DHT_DIGEST, self._on_digest),
        ):
            server.register(method, handler)

    # --- the replica's side ----------------------------------------------------------------------

    def _accept_items(self, items: Any, sender_now: Any) -> tuple[list[bool], list[str | None]]:
        if not isinstance(items, list) or len(items) > MAX_KEYS_PER_CALL:
            raise BadRequest(f"items must be a list of at most {MAX_KEYS_PER_CALL} [key, subkey, record]")
        now = world.wall()
        stored: list[bool] = []
        errors: list[str | None] = []
        for item in items:
            try:
                if not isinstance(item, list) or len(item) != 3:
                    raise RecordRejected("an item is [key, subkey, record]")
                key, subkey, raw = item
                record = Record.from_wire(raw)
                self.records.validate(key, subkey, record, now=now, sender_now=sender_now)
                stored.append(self.records.put(key, subkey, record, now=now))
                errors.append(None)
                self._replica_memo.setdefault(key, frozenset(m.node_id for m in self.replicas(key)))
            except RecordRejected as exc:
                stored.append(False)
                errors.append(str(exc))
        self._records_gauge.set(len(self.records))
        return stored, errors

    def _on_store(self, request: Request) -> Payload:
        meta = request.meta if isinstance(request.meta, dict) else {}
        self._introduce(meta.get("from"))
        stored, errors = self._accept_items(bulk.unpack("items", meta, request.tensors), meta.get("now"))
        return Payload({"stored": stored, "errors": errors})

    def _on_get(self, request: Request) -> Payload:
        keys = bulk.unpack("keys", request.meta, request.tensors)
        if (
            not isinstance(keys, list)
            or len(keys) > MAX_KEYS_PER_CALL
            or not all(isinstance(k, str) for k in keys)
        ):
            raise BadRequest(f"keys must be a list of at most {MAX_KEYS_PER_CALL} strings")
        now = world.wall()
        found = {}
        for key in keys:
            records = self.records.get(key, now=now)
            if records:
                found[key] = {subkey: record.to_wire() for subkey, record in records.items()}
        return Payload(*bulk.pack("records", found))

    def _on_digest(self, request: Request) -> Payload:
        """Anti-entropy: given (key -> subkey -> expiration), name what this replica lacks."""
        digest = bulk.unpack("digest", request.meta, request.tensors)
        if not isinstance(digest, dict) or len(digest) > MAX_KEYS_PER_CALL:
            raise BadRequest(f"digest must map at most {MAX_KEYS_PER_CALL} keys to {{subkey: expiration}}")
        now = world.wall()
        wanted = []
        for key, subkeys in digest.items():
            if not isinstance(key, str) or not isinstance(subkeys, dict):
                continue
            held = self.records.get(key, now=now)
            for subkey, expiration in subkeys.items():
                record = held.get(subkey)
                if record is None or (
                    isinstance(expiration, (int, float)) and record.expiration < expiration
                ):
                    wanted.append([key, subkey])
        return Payload(*bulk.pack("wanted", wanted))

    # --- calls to one replica ----------------------------------------------------------------------

    async def _store_at(self, member: Member, items: list[Item]) -> tuple[list[bool], list]:
        if member.node_id == self.node_id:
            return self._accept_items([[k, s, r.to_wire()] for k, s, r in items], None)
        fields, tensors = bulk.pack("items", [[k, s, r.to_wire()] for k, s, r in items])
        reply = await self.client.call(
            member.address,
            Method.DHT_STORE,
            {**fields, "now": world.wall(), "from": self._sender()},
            tensors,
            timeout_s=self.config.op_timeout_s,
        )
        meta = reply.meta if isinstance(reply.meta, dict) else {}
        return list(meta.get("stored") or []), list(meta.get("errors") or [])

    def _get_here(self, keys: list[str]) -> dict[str, dict[str, Record]]:
        now = world.wall()
        return {key: self.records.get(key, now=now) for key in keys}

    async def _get_at(self, member: Member, keys: list[str]) -> dict[str, dict[str, Record]]:
        if member.node_id == self.node_id:
            return self._get_here(keys)
        reply = await self.client.call(
            member.address, Method.DHT_GET, *bulk.pack("keys", keys), timeout_s=self.config.op_timeout_s
        )
        raw = bulk.unpack("records", reply.meta, reply.tensors, {})
        raw = raw if isinstance(raw, dict) else {}
        result: dict[str, dict[str, Record]] = {}
        for key in keys:
            subkeys = raw.get(key) or {}
            parsed = {}
            for subkey, wire in subkeys.items() if isinstance(subkeys, dict) else ():
                with contextlib.suppress(RecordRejected):
                    parsed[subkey] = Record.from_wire(wire)  # checked once merged: trust no replica
            result[key] = parsed
        return result

    # --- writes and reads ----------------------------------------------------------------------------

    async def write(self, key: str, subkey: str, record: Record) -> int:
        """Store ``record`` at every replica of ``key``; returns how many accepted it.

        Raises RecordRejected when a replica refused it, DhtError when none could be reached.
        """
        results = await asyncio.gather(
            *(self._store_at(m, [(key, subkey, record)]) for m in self.replicas(key)),
            return_exceptions=True,
        )
        accepted = 0
        for result in results:
            if isinstance(result, BaseException):
                continue
            _stored, errors = result
            if errors and errors[0]:
                raise RecordRejected(errors[0])
            accepted += 1
        if not accepted:
            raise DhtError(f"no replica of {key!r} could be reached: {[str(r) for r in results]}")
        return accepted

    async def read(self, keys: Sequence[str]) -> dict[str, dict[str, Record]]:
        """The newest valid record of every subkey of ``keys``, from a majority of each key's
        replicas (``reads``: which, and why that keeps read-your-writes)."""
        read = QuorumRead(
            keys,
            self.replicas,
            local_id=self.node_id,
            local=self._get_here,
            remote=self._get_at,
            hedge=self._hedge,
            rng=self._rng,
        )
        answers = await read.run()
        candidates: dict[str, dict[str, set[Record]]] = {key: {} for key in keys}
        for _member, answer in answers:
            for key, records in answer.items():
                for subkey, record in records.items():
                    candidates[key].setdefault(subkey, set()).add(record)
        merged: dict[str, dict[str, Record]] = {key: {} for key in keys}
        now = world.wall()
        for key, subkeys in candidates.items():
            for subkey, records in subkeys.items():
                # Newest first; a replica's copy counts only if it passes the rules a replica
                # applies on store (an owned subkey's signature above all).
                for record in sorted(records, key=lambda r: (r.expiration, r.value or b""), reverse=True):
                    try:
                        self.records.validate(key, subkey, record, now=now)
                    except RecordRejected:
                        continue
                    merged[key][subkey] = record
                    break
        self._repair(merged, answers)
        if read.late:  # repair those too once they answer, without holding up this read
            self._spawn(self._repair_late(merged, read.late))
        return merged

    async def _repair_late(self, merged, late: dict[asyncio.Task, Member]) -> None:
        # Bounded: at most R - Q calls per read, each ending by its op timeout; the node
        # cancels this (and with it the calls) when it stops.
        results = await asyncio.gather(*late, return_exceptions=True)
        self._repair(
            merged,
            [(m, r) for m, r in zip(late.values(), results, strict=True) if not isinstance(r, BaseException)],
        )

    def _repair(self, merged, answers: list[tuple[Member, dict]]) -> None:
        """Read repair: push the winning records to replicas that answered without them."""
        for member, answer in answers:
            stale = [
                (key, subkey, record)
                for key, records in answer.items()
                for subkey, record in merged[key].items()
                if subkey not in records or newer(record, records[subkey])
            ]
            if stale and member.node_id != self.node_id:
                self._spawn(self._quiet(self._store_at(member, stale)))
            elif stale:
                self._accept_items([[k, s, r.to_wire()] for k, s, r in stale], None)

    @staticmethod
    async def _quiet(coro) -> None:
        with contextlib.suppress(RpcError, DhtError):
            await coro

    # --- keeping replicas whole over time ----------------------------------------------------------

    async def handoff(self) -> bool:
        """Push each key's records to replicas that joined its replica set since we last did.

        Returns True when some could not be delivered: call again next period.
        """
        now = world.wall()
        outgoing: dict[str, tuple[Member, list[Item]]] = {}
        leaving: list[str] = []
        for key in self.records.keys():
            replicas = self.replicas(key)
            ids = frozenset(m.node_id for m in replicas)
            before = self._replica_memo.get(key, frozenset())
            if ids == before:
                continue
            records = self.records.get(key, now=now)
            for member in replicas:
                if member.node_id != self.node_id and member.node_id not in before:
                    batch = outgoing.setdefault(member.node_id, (member, []))[1]
                    batch.extend((key, subkey, record) for subkey, record in records.items())
            if self.node_id not in ids:
                leaving.append(key)
            self._replica_memo[key] = ids
        failed = await self._push(outgoing)
        unsent = {key for member_id in failed for key, _subkey, _record in outgoing[member_id][1]}
        for key in unsent:
            self._replica_memo.pop(key, None)  # hand it over again next period
        for key in leaving:  # no longer ours: drop once every new replica has it
            if key not in unsent:
                self.records.drop(key)
                self._replica_memo.pop(key, None)
        return bool(unsent)

    async def _push(self, outgoing: dict[str, tuple[Member, list[Item]]]) -> set[str]:
        """Send batches of records to members; returns the ids of members that failed."""
        failed: set[str] = set()

        async def push(member: Member, items: list[Item]) -> None:
            for start in range(0, len(items), MAX_KEYS_PER_CALL):
                try:
                    await self._store_at(member, items[start : start + MAX_KEYS_PER_CALL])
                except (RpcError, DhtError):
                    failed.add(member.node_id)
                    return

        await asyncio.gather(*(push(member, items) for member, items in outgoing.values()))
        return failed

    async def anti_entropy(self) -> None:
        """Compare (subkey, expiration) digests with the other replicas; send what they lack."""
        now = world.wall()
        digests: dict[str, tuple[Member, dict]] = {}
        for key in self.records.keys():
            records = self.records.get(key, now=now)
            for member in self.replicas(key):
                if member.node_id != self.node_id and records:
                    digests.setdefault(member.node_id, (member, {}))[1][key] = {
                        subkey: record.expiration for subkey, record in records.items()
                    }
        outgoing: dict[str, tuple[Member, list[Item]]] = {}

        async def compare(member: Member, digest: dict) -> None:
            keys = list(digest)
            for start in range(0, len(keys), MAX_KEYS_PER_CALL):
                part = {k: digest[k] for k in keys[start : start + MAX_KEYS_PER_CALL]}
                try:
                    reply = await self.client.call(
                        member.address,
                        Method.DHT_DIGEST,
                        *bulk.pack("digest", part),
                        timeout_s=self.config.op_timeout_s,
                    )
                except RpcError:
                    return
                wanted = bulk.unpack("wanted", reply.meta, reply.tensors, [])
                wanted = wanted if isinstance(wanted, list) else []
                for item in wanted:
                    if isinstance(item, list) and len(item) == 2:
                        record = self.records.get(str(item[0]), now=now).get(str(item[1]))
                        if record is not None:
                            batch = outgoing.setdefault(member.node_id, (member, []))[1]
                            batch.append((item[0], item[1], record))

        await asyncio.gather(*(compare(member, digest) for member, digest in digests.values()))
        await self._push(outgoing)
