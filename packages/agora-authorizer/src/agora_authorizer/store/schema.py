"""The authorizer's tables, defined once for SQLite and PostgreSQL (SQLAlchemy Core).

Column names match the fields of the row dataclasses in :mod:`.rows`, so a selected row maps
onto its dataclass by name. Times are wall-clock seconds in double precision. Serials and
request ids come from autoincrementing keys that never hand out a committed value twice
(``AUTOINCREMENT`` on SQLite, a sequence on PostgreSQL), so a credential's serial names it for
good. The indexes are on the columns the store's queries filter on.

Bump :data:`SCHEMA_VERSION` with any change to these tables: a store refuses to open a
database written under another version instead of misreading it, except the versions in
:data:`UPGRADES_FROM`, whose databases lack only tables added since (they are created and the
version moved on when such a database is opened).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    column,
)

SCHEMA_VERSION = 2  # 2: accusations, pardons
# Versions whose databases this one upgrades in place: it only added tables since.
UPGRADES_FROM = (1,)

BAN_KINDS = ("node", "account")
REQUEST_STATUSES = ("checking", "queued", "admitted", "refused")
DECIDED_STATUSES = ("admitted", "refused")  # the statuses that stamp a request's decided time
REVOKE_SCOPES = ("node", "account")  # what a revocation named: revoked_since lists accounts too

# 64-bit on PostgreSQL (a credential per node every few minutes adds up over a long run);
# SQLite needs the plain INTEGER spelling for a key to be its autoincrementing rowid.
Serial = BigInteger().with_variant(Integer(), "sqlite")


def _one_of(name: str, values: tuple[str, ...]) -> CheckConstraint:
    return CheckConstraint(column(name).in_(values), name=f"{name}_known")


metadata = MetaData()

schema_info = Table(
    "schema_info",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
)

accounts = Table(
    "accounts",
    metadata,
    Column("name", String, primary_key=True),
    Column("token_sha256", String(64), nullable=False),  # hex; the token itself is never stored
    Column("max_nodes", Integer, nullable=True),  # None: the run's [admission] max_nodes_per_account
    Column("created", Double, nullable=False),
)

bans = Table(
    "bans",
    metadata,
    Column("kind", String(16), nullable=False),
    Column("target", String, nullable=False),
    Column("reason", String, nullable=False),
    Column("created", Double, nullable=False, index=True),  # revoked_since filters on it
    PrimaryKeyConstraint("kind", "target"),
    _one_of("kind", BAN_KINDS),
)

pins = Table(
    "pins",
    metadata,
    Column("node_id", String, primary_key=True),
    Column("stage", Integer, nullable=False),
    Column("created", Double, nullable=False),
    CheckConstraint(column("stage") >= 0, name="stage_non_negative"),
)

# The primary key is the replay check: two processes inserting one nonce cannot both succeed.
nonces = Table(
    "nonces",
    metadata,
    Column("nonce", LargeBinary, primary_key=True),
    Column("seen", Double, nullable=False, index=True),  # forget_nonces filters on it
)

requests = Table(
    "requests",
    metadata,
    Column("id", Serial, primary_key=True, autoincrement=True),
    Column("node_id", String, nullable=False, index=True),
    Column("public_key", LargeBinary, nullable=False),
    Column("role", String(16), nullable=False),
    Column("address", String, nullable=False),
    Column("account", String, nullable=False),
    Column("hardware", JSON, nullable=False),
    Column("software", JSON, nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("reason", String, nullable=True),  # a RefusalReason code when refused
    Column("detail", String, nullable=True),
    Column("stage", Integer, nullable=True),  # the placement of a queued or admitted worker
    Column("checks", JSON, nullable=True),  # measurements: latency_ms, bandwidth_mbps, challenge_s...
    Column("received", Double, nullable=False),
    Column("decided", Double, nullable=True, index=True),  # refusals_by_reason(since=) filters on it
    _one_of("status", REQUEST_STATUSES),
    sqlite_autoincrement=True,
)

credentials = Table(
    "credentials",
    metadata,
    Column("serial", Serial, primary_key=True, autoincrement=True),
    Column("request_id", Serial, ForeignKey("requests.id"), nullable=True),  # None: a refresh
    Column("node_id", String, nullable=False),  # indexed with expires below
    Column("public_key", LargeBinary, nullable=False),
    Column("role", String(16), nullable=False),
    Column("stage", Integer, nullable=True),
    Column("account", String, nullable=False, index=True),
    Column("issued", Double, nullable=False),
    Column("expires", Double, nullable=False, index=True),
    Column("body", LargeBinary, nullable=False),  # the signed body and its signature, as sent
    Column("signature", LargeBinary, nullable=False),
    Column("revoked", Double, nullable=True, index=True),  # when; None while not revoked
    Column("revoked_scope", String(16), nullable=True),  # "node" or "account": what was revoked
    _one_of("revoked_scope", REVOKE_SCOPES),
    sqlite_autoincrement=True,
)

# latest_credential_of, live_credentials and revoke_node look a node up, the live ones by expiry
Index("credentials_live", credentials.c.node_id, credentials.c.expires)
# every join counts its account's queued requests (Store.standing)
Index("requests_account", requests.c.account, requests.c.status)

# What nodes accused each other of (agora_core.admission.accusations), as the authorizer last
# read it from the DHT: kept after the DHT entries expire, for the operator to list.
accusations = Table(
    "accusations",
    metadata,
    Column("accuser", String, nullable=False),
    Column("accused", String, nullable=False, index=True),
    Column("kind", String(32), nullable=False),  # not constrained: newer nodes may know more kinds
    Column("accuser_stage", Integer, nullable=False),  # as its entry says; its credential's counts
    Column("rounds", Integer, nullable=False),
    Column("at", Double, nullable=False),  # the accuser's clock: the newest round it saw
    Column("at_seen", Double, nullable=False),  # when the authorizer first read that ``at``
    Column("evidence", JSON, nullable=False),  # [{round, slice, chunk, measured, radius}, ...]
    Column("first_seen", Double, nullable=False),
    Column("last_seen", Double, nullable=False),
    PrimaryKeyConstraint("accuser", "accused", "kind"),
)

# A node's latest pardon: accusations made before it no longer count against it.
pardons = Table(
    "pardons",
    metadata,
    Column("node_id", String, primary_key=True),
    Column("pardoned", Double, nullable=False),
)
