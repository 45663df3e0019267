"""The authorizer's durable state, on SQLite (a file, the default) or PostgreSQL.

:class:`Store` is the one way in: accounts, bans and pins (what the operator decided), the
nonces of requests already seen, through :class:`~.admissions.Admissions` the admission
requests and credentials, and through :class:`~.accusations.AccusationRecords` the
accusations nodes made and the pardons. Each method is one transaction, committed before it
returns (see :mod:`.database`). The service calls the store from one dedicated thread; the
store keeps no state of its own but its engine, so other processes (the CLI) see each write
once it commits.
"""

from __future__ import annotations

import hashlib
import hmac

from sqlalchemy import delete, exc, func, insert, select

from agora_authorizer.store import schema
from agora_authorizer.store.accusations import AccusationRecords
from agora_authorizer.store.admissions import Admissions
from agora_authorizer.store.database import BUSY_TIMEOUT_S, AlreadyExists, Database
from agora_authorizer.store.rows import (
    Account,
    Ban,
    Standing,
    check_choice,
    check_stage,
    check_text,
    columns_of,
)

MAX_NONCE_BYTES = 64  # join requests use 16; anything longer is not a nonce
_NO_ACCOUNT_DIGEST = "0" * 64  # compared against for unknown names, so they take as long


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _account_if(row, token: str) -> Account | None:
    """The account of ``row`` (an accounts row with its token digest) if ``token`` is its
    token; the digest is compared even when there is no row."""
    expected = row.token_sha256 if row is not None else _NO_ACCOUNT_DIGEST
    if not hmac.compare_digest(_token_hash(token), expected) or row is None:
        return None
    return Account(name=row.name, max_nodes=row.max_nodes, created=row.created)


class Store(Admissions, AccusationRecords):
    """Accounts, bans, pins, nonces, admission requests and credentials, accusations and
    pardons; see the module doc.

    Arguments a caller got wrong raise ValueError; the database's own failures (unreachable,
    locked past the busy timeout, a missing record) raise :class:`StoreError`.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        self.url = db.url  # any password masked: safe to print
        self.backend = db.backend  # "sqlite" or "postgresql"

    @classmethod
    def open(cls, url: str, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Store:
        """Open ``url`` (see :func:`~.database.parse_url`), creating the tables if missing."""
        return cls(Database(url, busy_timeout_s=busy_timeout_s))

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    # --- contributor accounts -------------------------------------------------------------

    def add_account(self, name: str, token: str, *, max_nodes: int | None = None, now: float) -> None:
        """Create an account; only the token's SHA-256 is stored. AlreadyExists if taken."""
        check_text("an account name", name)
        check_text("an account token", token)
        if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 1):
            raise ValueError(f"max_nodes must be a positive int or None, not {max_nodes!r}")
        row = {"name": name, "token_sha256": _token_hash(token), "max_nodes": max_nodes, "created": now}
        try:
            with self._db.transaction(write=True) as connection:
                connection.execute(insert(schema.accounts).values(row))
        except exc.IntegrityError:
            raise AlreadyExists(f"an account named {name!r} exists already") from None

    def check_account(self, name: str, token: str) -> Account | None:
        """The account if ``token`` is its token; None for an unknown name or a wrong token
        (told apart by neither the answer nor, through the digest compare, its timing)."""
        table = schema.accounts
        with self._db.transaction() as connection:
            query = select(table.c.token_sha256, *columns_of(table, Account)).where(table.c.name == name)
            return _account_if(connection.execute(query).first(), token)

    def standing(self, name: str, token: str, node_id: str, *, now: float) -> Standing:
        """Everything the accountability check and placement read about a joiner, in one
        read transaction: its account (None: unknown or wrong token), bans, the account's
        other nodes in the run and in the queue (distinct nodes, this one left out), and the
        node's pin."""
        accounts, bans, pins = schema.accounts, schema.bans, schema.pins
        requests, credentials = schema.requests, schema.credentials

        def banned(kind: str, target: str):
            return select(bans.c.kind).where(bans.c.kind == kind, bans.c.target == target).exists()

        # the account's other nodes: a node joining again does not count against itself
        live = select(func.count(func.distinct(credentials.c.node_id))).where(
            credentials.c.account == name,
            credentials.c.expires > now,
            credentials.c.revoked.is_(None),
            credentials.c.node_id != node_id,
        )
        queued = select(func.count(func.distinct(requests.c.node_id))).where(
            requests.c.account == name, requests.c.status == "queued", requests.c.node_id != node_id
        )
        pin = select(pins.c.stage).where(pins.c.node_id == node_id)
        account = select(accounts.c.token_sha256, *columns_of(accounts, Account)).where(
            accounts.c.name == name
        )
        # one statement: this runs for every join, and each statement costs a round through the driver
        query = select(
            banned("account", name).label("account_banned"),
            banned("node", node_id).label("node_banned"),
            live.scalar_subquery().label("live"),
            queued.scalar_subquery().label("queued"),
            pin.scalar_subquery().label("pin"),
        )
        with self._db.transaction() as connection:
            row = connection.execute(account).first()
            found = connection.execute(query).one()
        return Standing(
            account=_account_if(row, token),
            account_banned=bool(found.account_banned),
            node_banned=bool(found.node_banned),
            live_nodes=found.live or 0,
            queued_nodes=found.queued or 0,
            pin=found.pin,
        )

    def accounts(self) -> list[Account]:
        table = schema.accounts
        with self._db.transaction() as connection:
            rows = connection.execute(select(*columns_of(table, Account)).order_by(table.c.name))
            return [Account(**row._mapping) for row in rows]

    # --- bans -------------------------------------------------------------------------------

    def ban(self, kind: str, target: str, *, reason: str, now: float) -> None:
        """Ban a node id or an account. Banning again changes nothing (the first ban stands)."""
        check_choice("a ban kind", kind, schema.BAN_KINDS)
        check_text("a ban target", target)
        if not isinstance(reason, str):
            raise ValueError(f"a ban reason is a string, not {reason!r}")
        query = self._db.upsert(schema.bans).values(kind=kind, target=target, reason=reason, created=now)
        query = query.on_conflict_do_nothing(index_elements=["kind", "target"])
        with self._db.transaction(write=True) as connection:
            connection.execute(query)

    def unban(self, kind: str, target: str) -> bool:
        """Lift a ban; False if there was none."""
        check_choice("a ban kind", kind, schema.BAN_KINDS)
        table = schema.bans
        with self._db.transaction(write=True) as connection:
            query = delete(table).where(table.c.kind == kind, table.c.target == target)
            return connection.execute(query).rowcount > 0

    def is_banned(self, kind: str, target: str) -> bool:
        check_choice("a ban kind", kind, schema.BAN_KINDS)
        table = schema.bans
        with self._db.transaction() as connection:
            query = select(table.c.kind).where(table.c.kind == kind, table.c.target == target)
            return connection.execute(query).first() is not None

    def bans(self) -> list[Ban]:
        table = schema.bans
        with self._db.transaction() as connection:
            query = select(*columns_of(table, Ban)).order_by(table.c.created, table.c.kind, table.c.target)
            return [Ban(**row._mapping) for row in connection.execute(query)]

    # --- operator pins ----------------------------------------------------------------------

    def pin(self, node_id: str, stage: int, *, now: float) -> None:
        """Place ``node_id`` on ``stage`` whenever it joins; replaces an earlier pin."""
        check_text("a node id", node_id)
        if check_stage(stage) is None:
            raise ValueError("a pin needs a stage")
        query = self._db.upsert(schema.pins).values(node_id=node_id, stage=stage, created=now)
        query = query.on_conflict_do_update(index_elements=["node_id"], set_={"stage": stage, "created": now})
        with self._db.transaction(write=True) as connection:
            connection.execute(query)

    def unpin(self, node_id: str) -> bool:
        table = schema.pins
        with self._db.transaction(write=True) as connection:
            return connection.execute(delete(table).where(table.c.node_id == node_id)).rowcount > 0

    def pin_of(self, node_id: str) -> int | None:
        table = schema.pins
        with self._db.transaction() as connection:
            return connection.scalar(select(table.c.stage).where(table.c.node_id == node_id))

    # --- replay protection ------------------------------------------------------------------

    def remember_nonce(self, nonce: bytes, *, now: float) -> bool:
        """True the first time ``nonce`` is seen, False ever after (until forgotten). The
        primary key decides, so two processes racing on one nonce cannot both get True."""
        if not isinstance(nonce, bytes) or not 0 < len(nonce) <= MAX_NONCE_BYTES:
            raise ValueError(f"a nonce is 1 to {MAX_NONCE_BYTES} bytes")
        try:
            with self._db.transaction(write=True) as connection:
                connection.execute(insert(schema.nonces).values(nonce=nonce, seen=now))
        except exc.IntegrityError:
            return False
        return True

    def forget_nonces(self, *, before: float) -> int:
        """Drop nonces first seen before ``before`` (requests that old are refused as stale
        anyway); returns how many."""
        with self._db.transaction(write=True) as connection:
            return connection.execute(delete(schema.nonces).where(schema.nonces.c.seen < before)).rowcount
