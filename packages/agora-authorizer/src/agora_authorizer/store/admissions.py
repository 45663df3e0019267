"""The admission records: join requests, what was decided about them, and the credentials issued.

A request is recorded as it arrives ("checking"), moves to "queued" with its placement once
its checks pass, and ends "admitted" (by :meth:`Admissions.issue_credential`, in the same
transaction as its credential) or "refused" with a reason code. Credentials are never
deleted: a serial names one credential for good, and revocation marks rows instead.
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy import func, insert, select, update

from agora_authorizer.store import schema
from agora_authorizer.store.database import Banned, Database, NotFound
from agora_authorizer.store.rows import (
    AdmissionRequest,
    IssuedCredential,
    check_choice,
    check_stage,
    check_text,
    columns_of,
)
from agora_core.admission.credential import ROLES

_PENDING = ("checking", "queued")  # the statuses issue_credential may admit from


class Admissions:
    """The request and credential methods of :class:`~agora_authorizer.store.Store`."""

    _db: Database

    def add_request(
        self,
        *,
        node_id: str,
        public_key: bytes,
        role: str,
        address: str,
        account: str,
        hardware: dict,
        software: dict,
        now: float,
    ) -> int:
        """Record a join request as "checking"; returns its id (increasing with arrival)."""
        check_text("a node id", node_id)
        check_choice("a role", role, ROLES)
        if not isinstance(public_key, bytes) or not isinstance(address, str) or not isinstance(account, str):
            raise ValueError("public_key must be bytes, address and account strings")
        if not isinstance(hardware, dict) or not isinstance(software, dict):
            raise ValueError("hardware and software must be dicts")
        row = {
            "node_id": node_id,
            "public_key": public_key,
            "role": role,
            "address": address,
            "account": account,
            "hardware": hardware,
            "software": software,
            "status": "checking",
            "received": now,
        }
        with self._db.transaction(write=True) as connection:
            return connection.execute(insert(schema.requests).values(row)).inserted_primary_key[0]

    def record_request(self, *, nonce: bytes, now: float, **fields) -> int | None:
        """:meth:`add_request` and the request's nonce in one transaction (one commit per
        arrival); None, and nothing recorded, when the nonce was seen before (a replay)."""
        check_text("a node id", fields.get("node_id"))
        check_choice("a role", fields.get("role"), ROLES)
        row = {**fields, "status": "checking", "received": now}
        try:
            with self._db.transaction(write=True) as connection:
                connection.execute(insert(schema.nonces).values(nonce=nonce, seen=now))
                return connection.execute(insert(schema.requests).values(row)).inserted_primary_key[0]
        except sa.exc.IntegrityError:
            return None

    def add_unopened_request(self, *, now: float) -> int:
        """Record a request that could not even be opened (malformed, or not signed by the key
        it names): its fields are not to be trusted, so none are kept. Returns its id; the
        caller refuses it with the reason."""
        row = {
            "node_id": "",
            "public_key": b"",
            "role": "",
            "address": "",
            "account": "",
            "hardware": {},
            "software": {},
            "status": "checking",
            "received": now,
        }
        with self._db.transaction(write=True) as connection:
            return connection.execute(insert(schema.requests).values(row)).inserted_primary_key[0]

    def interrupt_checking(self, *, now: float) -> int:
        """Refuse every request still "checking" as interrupted (the authorizer died while
        checking it, so its joiner never had an answer); returns how many."""
        table = schema.requests
        values = {
            "status": "refused",
            "reason": "interrupted",
            "detail": "the authorizer restarted while checking this request: send a fresh one",
            "decided": now,
        }
        with self._db.transaction(write=True) as connection:
            return connection.execute(
                update(table).where(table.c.status == "checking").values(values)
            ).rowcount

    def set_request(
        self,
        request_id: int,
        *,
        status: str,
        reason: str | None = None,
        detail: str | None = None,
        stage: int | None = None,
        checks: dict | None = None,
        now: float,
    ) -> None:
        """Move a request to ``status``. Arguments left None keep their stored value; a given
        ``checks`` replaces the stored one. Admitting or refusing stamps ``decided`` with
        ``now``; a refusal needs its reason code. NotFound for an unknown id."""
        check_choice("a request status", status, schema.REQUEST_STATUSES)
        if status == "refused" and not reason:
            raise ValueError("a refusal needs a reason code")
        check_stage(stage)
        if checks is not None and not isinstance(checks, dict):
            raise ValueError("checks must be a dict of measurements")
        values: dict = {"status": status}
        given = {"reason": reason, "detail": detail, "stage": stage, "checks": checks}
        values.update({name: value for name, value in given.items() if value is not None})
        if status in schema.DECIDED_STATUSES:
            values["decided"] = now
        table = schema.requests
        with self._db.transaction(write=True) as connection:
            result = connection.execute(update(table).where(table.c.id == request_id).values(values))
            if result.rowcount == 0:
                raise NotFound(f"no admission request {request_id}")

    def request(self, request_id: int) -> AdmissionRequest | None:
        return self._first_request(schema.requests.c.id == request_id)

    def latest_request_of(self, node_id: str) -> AdmissionRequest | None:
        table = schema.requests
        return self._first_request(table.c.node_id == node_id, order=table.c.id.desc())

    def _first_request(self, where, order=None) -> AdmissionRequest | None:
        query = select(*columns_of(schema.requests, AdmissionRequest)).where(where)
        with self._db.transaction() as connection:
            row = connection.execute(query.order_by(order).limit(1)).first()
        return None if row is None else AdmissionRequest(**row._mapping)

    def queued(self) -> list[AdmissionRequest]:
        """The queued requests in arrival (id) order."""
        table = schema.requests
        query = select(*columns_of(table, AdmissionRequest)).where(table.c.status == "queued")
        with self._db.transaction() as connection:
            rows = connection.execute(query.order_by(table.c.id))
            return [AdmissionRequest(**row._mapping) for row in rows]

    def queued_stages(self) -> dict[int, int]:
        """stage -> how many queued requests are placed on it (requests without a stage are left out)."""
        table = schema.requests
        placed = sa.and_(table.c.status == "queued", table.c.stage.is_not(None))
        return self._counts(select(table.c.stage, func.count()).where(placed).group_by(table.c.stage))

    def refusals_by_reason(self, *, since: float | None = None) -> dict[str, int]:
        """reason code -> refusals decided at or after ``since`` (all of them if None)."""
        table = schema.requests
        query = select(table.c.reason, func.count()).where(table.c.status == "refused")
        if since is not None:
            query = query.where(table.c.decided >= since)
        return self._counts(query.group_by(table.c.reason))

    def requests_by_status(self) -> dict[str, int]:
        """status -> how many requests have it (statuses no request has are left out)."""
        table = schema.requests
        return self._counts(select(table.c.status, func.count()).group_by(table.c.status))

    def _counts(self, query) -> dict:
        with self._db.transaction() as connection:
            return {key: count for key, count in connection.execute(query)}

    # --- credentials ------------------------------------------------------------------------

    def issue_credential(
        self,
        *,
        request_id: int | None,
        node_id: str,
        public_key: bytes,
        role: str,
        stage: int | None,
        account: str,
        issued: float,
        expires: float,
        sign: Callable[[int], tuple[bytes, bytes]],
        checks: dict | None = None,
    ) -> IssuedCredential:
        """Assign the next serial, have ``sign(serial)`` return (body, signature), store them
        and, given ``request_id``, admit that request (decided at ``issued``, on ``stage``), all
        in one transaction: the admission and its credential commit together or not at all.
        ``sign`` runs while the transaction holds the write lock: it must be quick and must
        not use the store. Banned (nothing issued) when the node or its account is banned,
        checked in the same transaction, so a ban that lands while a node waits in the queue
        or refreshes is never outrun. The request must be of ``node_id`` and still checking or queued;
        ``checks`` (its measurements) are stored with it when given (an admission straight
        from the checks, never queued)."""
        check_text("a node id", node_id)
        check_choice("a role", role, ROLES)
        check_stage(stage)
        if not isinstance(public_key, bytes) or not isinstance(account, str):
            raise ValueError("public_key must be bytes and account a string")
        if not expires > issued:
            raise ValueError(f"a credential must expire after it is issued ({issued} >= {expires})")
        row = {
            "request_id": request_id,
            "node_id": node_id,
            "public_key": public_key,
            "role": role,
            "stage": stage,
            "account": account,
            "issued": issued,
            "expires": expires,
        }
        requests, credentials = schema.requests, schema.credentials
        bans = schema.bans
        with self._db.transaction(write=True) as connection:
            ban = select(bans.c.kind, bans.c.target).where(
                ((bans.c.kind == "node") & (bans.c.target == node_id))
                | ((bans.c.kind == "account") & (bans.c.target == account))
            )
            found = connection.execute(ban.limit(1)).first()
            if found is not None:
                raise Banned(found.kind, found.target)
            if request_id is not None:
                admit = update(requests).where(
                    requests.c.id == request_id,
                    requests.c.node_id == node_id,
                    requests.c.status.in_(_PENDING),
                )
                values = {"status": "admitted", "decided": issued, "stage": stage}
                admitted = admit.values(values if checks is None else {**values, "checks": checks})
                if connection.execute(admitted).rowcount == 0:
                    raise NotFound(f"no checking or queued admission request {request_id} of node {node_id}")
            placeholder = {"body": b"", "signature": b""}  # NOT NULL: replaced before commit
            inserted = connection.execute(insert(credentials).values({**row, **placeholder}))
            serial = inserted.inserted_primary_key[0]
            body, signature = sign(serial)
            if not isinstance(body, bytes) or not isinstance(signature, bytes):
                raise TypeError("sign(serial) must return (body: bytes, signature: bytes)")
            signed = {"body": body, "signature": signature}
            connection.execute(update(credentials).where(credentials.c.serial == serial).values(signed))
        return IssuedCredential(serial=serial, **row, **signed, revoked=None)

    def credential(self, serial: int) -> IssuedCredential | None:
        return self._first_credential(schema.credentials.c.serial == serial)

    def latest_credential_of(self, node_id: str) -> IssuedCredential | None:
        """The node's newest credential, whether live, expired or revoked."""
        return self._first_credential(schema.credentials.c.node_id == node_id)

    def _first_credential(self, where) -> IssuedCredential | None:
        table = schema.credentials
        query = select(*columns_of(table, IssuedCredential)).where(where).order_by(table.c.serial.desc())
        with self._db.transaction() as connection:
            row = connection.execute(query.limit(1)).first()
        return None if row is None else IssuedCredential(**row._mapping)

    @staticmethod
    def _live(now: float):
        table = schema.credentials
        return sa.and_(table.c.expires > now, table.c.revoked.is_(None))

    def live_credentials(self, *, now: float) -> list[IssuedCredential]:
        """Unexpired, unrevoked credentials, only the newest of each node, in serial order."""
        table = schema.credentials
        newest = select(func.max(table.c.serial)).where(self._live(now)).group_by(table.c.node_id)
        query = select(*columns_of(table, IssuedCredential)).where(table.c.serial.in_(newest))
        with self._db.transaction() as connection:
            rows = connection.execute(query.order_by(table.c.serial))
            return [IssuedCredential(**row._mapping) for row in rows]

    def live_nodes_of_account(self, account: str, *, now: float) -> int:
        """How many distinct nodes of ``account`` hold a live credential."""
        table = schema.credentials
        nodes = func.count(table.c.node_id.distinct())
        query = select(nodes).where(table.c.account == account, self._live(now))
        with self._db.transaction() as connection:
            return connection.scalar(query)

    def revoke_node(self, node_id: str, *, now: float) -> int:
        """Mark every unrevoked credential of ``node_id`` revoked (expired ones too: peers
        accept a credential a little past its expiry); returns how many."""
        return self._revoke(schema.credentials.c.node_id == node_id, scope="node", now=now)

    def revoke_account(self, account: str, *, now: float) -> int:
        """Mark every unrevoked credential issued under ``account`` revoked; returns how many."""
        return self._revoke(schema.credentials.c.account == account, scope="account", now=now)

    def _revoke(self, where, *, scope: str, now: float) -> int:
        table = schema.credentials
        query = update(table).where(where, table.c.revoked.is_(None))
        with self._db.transaction(write=True) as connection:
            return connection.execute(query.values(revoked=now, revoked_scope=scope)).rowcount

    def revoked_since(self, *, since: float, now: float | None = None) -> tuple[list[str], list[str]]:
        """(node ids, accounts) banned or revoked at or after ``since``, sorted, for the DHT
        revocation list. The node ids include every node whose credential was revoked, an
        account revocation's too, and (given ``now``) every node holding a revoked credential
        still unexpired then, however long ago it was revoked: an operator's credentials live
        for weeks."""
        bans, credentials = schema.bans, schema.credentials
        revoked = credentials.c.revoked >= since
        if now is not None:
            revoked = sa.or_(
                revoked, sa.and_(credentials.c.revoked.is_not(None), credentials.c.expires > now)
            )
        banned_since = select(bans.c.kind, bans.c.target).where(bans.c.created >= since)
        with self._db.transaction() as connection:
            banned = connection.execute(banned_since).all()
            nodes = set(connection.scalars(select(credentials.c.node_id).where(revoked).distinct()))
            account_wide = sa.and_(revoked, credentials.c.revoked_scope == "account")
            accounts = set(connection.scalars(select(credentials.c.account).where(account_wide).distinct()))
        nodes.update(target for kind, target in banned if kind == "node")
        accounts.update(target for kind, target in banned if kind == "account")
        return sorted(nodes), sorted(accounts)
