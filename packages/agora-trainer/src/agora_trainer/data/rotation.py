"""A trainer's part in shard rotation: obey the operator's assignment, tell the others what it holds.

Every ``interval_s`` (the trainer's progress interval) the trainer reads, in one DHT round,
the operator's assignment records (``rotation_record``) and the other trainers' shard claims
of its epoch, then publishes its own claim: the shards it holds open, with their progress,
and those it finished this epoch. Its cursor (``cursor.SampleCursor``) opens no shard another
trainer holds or finished this epoch; a shard whose holder has published nothing for
``adopt_after_s`` is adopted from the progress it last published (that holder's samples
completed since its last claim, at most one interval's, run again), and so at once is one
its holder released by stopping cleanly (its last claim is exact). A trainer that finds
another holding a shard it also holds, claimed later, yields it: the later reader keeps it.

A claim names the shard set (a digest of its shards' digests): trainers of one run on
another set (remade shards) never read each other's claims as their own.

Claims live under ``<run>/data/shards/epoch-<n>``, one signed entry per trainer, refreshed
every round and living as long as the DHT allows (about 58 minutes by default) after the last, so
the shards finished in an epoch stay known to the other trainers.

The assignment obeyed is kept in the cursor's state file: a record expires from the DHT, the
order stands until a newer record replaces it (``rotation_record``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from agora_core import world
from agora_core.dht import DhtError, DhtNode, DhtValue
from agora_core.dht.owned import OwnedEntry
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.injection.operators import OperatorKeys
from agora_core.injection.record import InjectionRejected
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.rotation_record import (
    RotationError,
    ShardAssignment,
    format_ranges,
    shard_assignment_key,
)

log = get_logger("rotation")


def shard_claims_key(run_name: str, epoch: int) -> str:
    return f"{run_name}/data/shards/epoch-{epoch}"


class OtherTrainers:
    """The other trainers' claims of one epoch, as last read (``cursor.Others``)."""

    def __init__(self, me: str, shard_set: str, adopt_after_s: float, clock=lambda: world.wall()):
        """``shard_set``: the shard set's identity; claims on another set are not this one's."""
        self._me = me
        self._set = shard_set
        self.adopt_after_s = adopt_after_s
        self._clock = clock
        self.epoch: int | None = None  # the epoch read; other epochs are "unknown"
        self.claims: dict[str, dict[str, Any]] = {}  # node id -> its claim

    def update(self, epoch: int, found: dict[str, DhtValue]) -> None:
        claims = {}
        for value in found.values():
            claim = value.value
            if not isinstance(claim, dict) or value.writer is None or claim.get("epoch") != epoch:
                continue
            if claim.get("set") != self._set:
                continue
            node_id = claim.get("node_id")
            if node_id == self._me or not isinstance(node_id, str):
                continue
            if not isinstance(claim.get("open"), list) or not isinstance(claim.get("finished"), list):
                continue
            claims[node_id] = claim
        self.epoch, self.claims = epoch, claims

    def _fresh(self, claim: dict[str, Any]) -> bool:
        """Its trainer still reads what it holds: it did not release it (stopping cleanly) and
        published within ``adopt_after_s``."""
        return not claim.get("released") and self._clock() - float(claim.get("t", 0.0)) <= self.adopt_after_s

    def state(self, epoch: int, shard_id: int) -> tuple[str, Any]:
        if epoch != self.epoch:
            return "unknown", None
        stale = None
        for claim in self.claims.values():
            if shard_id in claim["finished"]:
                return "finished", None
            for progress in claim["open"]:
                if isinstance(progress, dict) and progress.get("shard") == shard_id:
                    if self._fresh(claim):
                        return "held", None
                    if stale is None or progress.get("watermark", 0) > stale.get("watermark", 0):
                        stale = progress
        return ("stale", stale) if stale is not None else ("free", None)

    def newer_holder(self, epoch: int, shard_id: int, since: float) -> str | None:
        """A live trainer that finished this shard, or holds it since after ``since``."""
        if epoch != self.epoch:
            return None
        for node_id, claim in self.claims.items():
            if shard_id in claim["finished"]:
                return node_id
            for progress in claim["open"]:
                if isinstance(progress, dict) and progress.get("shard") == shard_id:
                    if self._fresh(claim) and float(progress.get("since", 0.0)) > since:
                        return node_id
        return None


class ShardRotation:
    def __init__(
        self,
        *,
        dht: DhtNode,
        key: NodeKey,
        run_name: str,
        shard_set: str,
        cursor: SampleCursor,
        operators: OperatorKeys,
        interval_s: float,
        adopt_after_s: float,
        claim_ttl_s: float,
        metrics: NodeMetrics,
    ):
        self._dht, self._key, self._run = dht, key, run_name
        self.cursor = cursor
        self._own = cursor.assigned  # this trainer's --shard-ranges (or all): where no record says otherwise
        self._operators = operators
        self.interval_s = interval_s
        self._set = shard_set
        self.others = OtherTrainers(key.node_id, shard_set, adopt_after_s)
        cursor.others = self.others
        self.claim_ttl_s = claim_ttl_s
        self.record: ShardAssignment | None = None  # the one obeyed now
        if cursor.assignment is not None:  # obeyed before a restart: it stands
            try:
                self.record = ShardAssignment.from_value(cursor.assignment)
            except RotationError as exc:
                log.warning("saved_shard_assignment_unreadable", error=str(exc))
        self.ignored: set[str] = set()  # subkeys of records not obeyed (logged once each)
        self._published: set[int] = set()  # epochs this trainer has a claim in
        self._task: asyncio.Task | None = None
        self._m_assigned = metrics.gauge("agora_trainer_shards_assigned", "Shards this trainer may read.")
        self._m_epoch = metrics.gauge("agora_trainer_epoch", "The epoch this trainer reads.")
        self._m_yielded = metrics.counter(
            "agora_trainer_shards_yielded_total", "Open shards handed to a trainer that adopted them."
        )
        self._m_assigned.set(len(cursor.assigned))

    async def start(self) -> None:
        """One round now (the cursor opens nothing before the others' claims are read), then
        one every ``interval_s`` in the background."""
        await self.tick()
        await self.start_background()

    async def start_background(self) -> None:
        """Only the background rounds (the first one failed: the next comes an interval later)."""
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="trainer-rotation")

    async def stop(self, *, publish: bool = True) -> None:
        """No more rounds; with ``publish``, a last claim that releases what this trainer holds
        (another trainer may go on from where it stopped at once; restarted, it goes on itself
        unless one did)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if not publish:
            return
        try:
            await self.publish(released=True)
        except (DhtError, RpcError) as exc:
            log.warning("shard_claim_failed", error=str(exc))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except (DhtError, RpcError) as exc:
                log.warning("shard_rotation_failed", error=str(exc))

    async def tick(self) -> None:
        epoch = self.cursor.epoch
        assignments, claims = shard_assignment_key(self._run), shard_claims_key(self._run, epoch)
        found = await self._dht.get_many([assignments, claims])
        self._obey(found[assignments])
        self.others.update(epoch, found[claims])
        self._yield_adopted()
        await self.publish()

    # --- the operator's record ------------------------------------------------------------------

    def _obey(self, found: dict[str, DhtValue]) -> None:
        newest = self.record  # the last one obeyed stands until a newer one comes
        for subkey, value in found.items():
            try:
                record = ShardAssignment.from_value(value.value)
                self._operators.check_record(subkey, value, record.id, record.credential)
            except (RotationError, InjectionRejected) as exc:
                if subkey not in self.ignored:
                    self.ignored.add(subkey)
                    log.warning("shard_assignment_ignored", subkey=subkey[-40:], reason=str(exc))
                continue
            if newest is None or record.issued > newest.issued:
                newest = record
        shards = self._own if newest is None else newest.for_trainer(self._key.node_id)
        shards = self._own if shards is None else shards
        if newest is not None and (self.record is None or newest.id != self.record.id):
            log.info("shard_assignment_read", record=newest.id, assignment=newest.describe())
            self.cursor.assignment = newest.to_value()
            self.cursor.save()  # the order obeyed stands across a restart
        self.record = newest
        if shards != self.cursor.assigned:
            usable_from = 0.0 if newest is None else newest.issued + newest.handover_s
            self.cursor.assign(shards, usable_from=usable_from)
            log.info(
                "shards_assigned",
                record=None if newest is None else newest.id,
                shards=format_ranges(shards) or "-",
                from_next_shard=True,
            )
            self._m_assigned.set(len(shards))

    # --- the other trainers ---------------------------------------------------------------------

    def _yield_adopted(self) -> None:
        for progress in self.cursor.holding():
            holder = self.others.newer_holder(progress.epoch, progress.shard_id, progress.since)
            if holder is not None and self.cursor.yield_shard(progress.epoch, progress.shard_id):
                self._m_yielded.inc()
                log.warning("shard_yielded", shard=progress.shard_id, epoch=progress.epoch, to=holder[:12])

    async def publish(self, *, released: bool = False) -> None:
        """This trainer's claim in every epoch it holds shards of (and once more in an epoch it
        has just left, so its claim there ends with every shard it finished)."""
        holding = self.cursor.holding()
        epochs = {self.cursor.epoch} | {p.epoch for p in holding}
        now = world.wall()
        for epoch in sorted(epochs | self._published):
            claim = {
                "node_id": self._key.node_id,
                "set": self._set,
                "epoch": epoch,
                "released": released,
                "t": now,
                "open": [p.to_value() for p in holding if p.epoch == epoch],
                "finished": self.cursor.finished_in(epoch),
            }
            entry = OwnedEntry(self._dht, self._key, shard_claims_key(self._run, epoch))
            await entry.publish(claim, self.claim_ttl_s)
        self._published = epochs
        self._m_epoch.set(self.cursor.epoch)
