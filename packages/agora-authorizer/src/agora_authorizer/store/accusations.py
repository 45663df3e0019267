"""The accusation records: what nodes accused each other of, the bans they led to, pardons.

The authorizer copies every accusation it reads in the DHT here (one row per accuser, accused
and kind, overwritten with the accuser's latest entry), so the operator can list them after
the DHT entries expire. A pardon lifts a node's ban and records when: accusations made
before it count against the node no more (:attr:`RecordedAccusation.made`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import sqlalchemy as sa
from sqlalchemy import delete, func, select

from agora_authorizer.store import schema
from agora_authorizer.store.database import Database
from agora_authorizer.store.rows import (
    Docket,
    IssuedCredential,
    Pardon,
    RecordedAccusation,
    check_text,
    columns_of,
)
from agora_core.admission.accusations import AccuserRecord

_UPDATED = ("accuser_stage", "rounds", "at", "evidence", "last_seen")  # what a new reading overwrites
NO_STAGE = -1  # accuser_stage of a trainer's entry (it serves no stage)


def _rows(records: Iterable[AccuserRecord], now: float) -> dict[tuple[str, str, str], dict]:
    """(accuser, accused, kind) -> its row; of an entry naming one twice, the newest."""
    rows: dict[tuple[str, str, str], dict] = {}
    for record in records:
        for accusation in record.accusations:
            key = (record.accuser, accusation.accused, accusation.kind)
            if key in rows and rows[key]["at"] >= accusation.at:
                continue
            rows[key] = {
                "accuser": record.accuser,
                "accused": accusation.accused,
                "kind": accusation.kind,
                "accuser_stage": NO_STAGE if record.stage is None else record.stage,
                "rounds": accusation.rounds,
                "at": accusation.at,
                "at_seen": now,
                "evidence": [dataclasses.asdict(e) for e in accusation.evidence],
                "first_seen": now,
                "last_seen": now,
            }
    return rows


class AccusationRecords:
    """The accusation and pardon methods of :class:`~agora_authorizer.store.Store`."""

    _db: Database

    def record_accusations(self, records: Iterable[AccuserRecord], *, now: float) -> list[RecordedAccusation]:
        """Record the accusations of ``records`` (parsed DHT entries), read at ``now``; returns
        those never recorded before. ``at_seen`` moves to ``now`` only when ``at`` changed."""
        rows = _rows(records, now)
        if not rows:
            return []
        table = schema.accusations
        insert = self._db.upsert(table)
        changed = sa.case(
            (table.c.at != insert.excluded.at, insert.excluded.last_seen), else_=table.c.at_seen
        )
        upsert = insert.on_conflict_do_update(
            index_elements=["accuser", "accused", "kind"],
            set_={**{name: insert.excluded[name] for name in _UPDATED}, "at_seen": changed},
        )
        accusers = sorted({accuser for accuser, _, _ in rows})
        with self._db.transaction(write=True) as connection:
            known = select(table.c.accuser, table.c.accused, table.c.kind).where(
                table.c.accuser.in_(accusers)
            )
            old = {tuple(row) for row in connection.execute(known)}
            connection.execute(upsert, list(rows.values()))
        return [RecordedAccusation(**row) for key, row in rows.items() if key not in old]

    def docket(
        self, *, accused: str | None = None, live_at: float | None = None, with_banned: bool = False
    ) -> Docket:
        """The recorded accusations (against ``accused`` only, if given; against nodes not
        banned, unless ``with_banned``; by accusers holding a credential live at ``live_at``
        only, if given), newest first, with the newest credential of every node they name,
        the accused's pardons, and which of them are banned."""
        table, bans, pardons = schema.accusations, schema.bans, schema.pardons
        credentials = schema.credentials
        banned_nodes = select(bans.c.target).where(bans.c.kind == "node")
        where = []
        if accused is not None:
            where.append(table.c.accused == accused)
        if not with_banned:
            where.append(table.c.accused.not_in(banned_nodes))
        if live_at is not None:
            live = select(credentials.c.node_id).where(
                credentials.c.expires > live_at, credentials.c.revoked.is_(None)
            )
            where.append(table.c.accuser.in_(live))
        query = select(*columns_of(table, RecordedAccusation)).where(*where)
        named = sa.union(select(table.c.accuser).where(*where), select(table.c.accused).where(*where))
        newest = select(func.max(credentials.c.serial)).where(credentials.c.node_id.in_(named))
        newest = newest.group_by(credentials.c.node_id)
        accused_ids = select(table.c.accused).where(*where)
        with self._db.transaction() as connection:
            rows = connection.execute(query.order_by(table.c.at.desc(), table.c.accuser, table.c.kind))
            accusations = tuple(RecordedAccusation(**row._mapping) for row in rows)
            held = connection.execute(
                select(*columns_of(credentials, IssuedCredential)).where(credentials.c.serial.in_(newest))
            )
            newest_of = {row.node_id: IssuedCredential(**row._mapping) for row in held}
            pardoned = connection.execute(
                select(pardons.c.node_id, pardons.c.pardoned).where(pardons.c.node_id.in_(accused_ids))
            )
            banned = connection.scalars(banned_nodes.where(bans.c.target.in_(accused_ids)))
            return Docket(
                accusations=accusations,
                credentials=newest_of,
                pardons={node_id: at for node_id, at in pardoned},
                banned=frozenset(banned),
            )

    def ban_accused(self, node_id: str, *, reason: str, pardoned: float | None, now: float) -> int | None:
        """Ban ``node_id`` and revoke its credentials, in one transaction, unless it is banned
        already or its latest pardon is no longer ``pardoned`` (one came in since the caller
        read its accusations): None then, and nothing changed. Returns how many credentials
        were revoked."""
        check_text("a node id", node_id)
        bans, credentials, pardons = schema.bans, schema.credentials, schema.pardons
        with self._db.transaction(write=True) as connection:
            banned = select(bans.c.target).where(bans.c.kind == "node", bans.c.target == node_id)
            latest = connection.scalar(select(pardons.c.pardoned).where(pardons.c.node_id == node_id))
            if connection.execute(banned).first() is not None or latest != pardoned:
                return None
            ban = self._db.upsert(bans).values(kind="node", target=node_id, reason=reason, created=now)
            ban = ban.on_conflict_do_nothing(index_elements=["kind", "target"])
            if connection.execute(ban).rowcount == 0:  # PostgreSQL: an operator's ban came in first
                return None
            revoke = sa.update(credentials).where(
                credentials.c.node_id == node_id, credentials.c.revoked.is_(None)
            )
            return connection.execute(revoke.values(revoked=now, revoked_scope="node")).rowcount

    def pardon(self, node_id: str, *, now: float) -> Pardon:
        """Lift ``node_id``'s ban and record a pardon: the accusations made against it so far
        count no more. Nothing is recorded (``pardoned`` None) when the node is neither banned
        nor accused since its previous pardon. The pardon's time is ``now``, or later if an
        accusation was read later by the authorizer's clock (another machine's), so that
        every accusation recorded before it is forgiven."""
        check_text("a node id", node_id)
        bans, table, pardons = schema.bans, schema.accusations, schema.pardons
        with self._db.transaction(write=True) as connection:
            is_node = sa.and_(bans.c.kind == "node", bans.c.target == node_id)
            reason = connection.scalar(select(bans.c.reason).where(is_node))
            connection.execute(delete(bans).where(is_node))
            previous = connection.scalar(select(pardons.c.pardoned).where(pardons.c.node_id == node_id))
            against = [table.c.accused == node_id]
            if previous is not None:  # made after it: at and at_seen both later (RecordedAccusation.made)
                against += [table.c.at > previous, table.c.at_seen > previous]
            forgiven = connection.scalar(select(func.count()).where(*against))
            if reason is None and not forgiven:
                return Pardon(node_id=node_id, ban_reason=None, forgiven=0, pardoned=None)
            seen = connection.scalar(select(func.max(table.c.at_seen)).where(table.c.accused == node_id))
            pardoned = max(now, seen or now)
            upsert = self._db.upsert(pardons).values(node_id=node_id, pardoned=pardoned)
            connection.execute(
                upsert.on_conflict_do_update(index_elements=["node_id"], set_={"pardoned": pardoned})
            )
        return Pardon(node_id=node_id, ban_reason=reason, forgiven=forgiven, pardoned=pardoned)
