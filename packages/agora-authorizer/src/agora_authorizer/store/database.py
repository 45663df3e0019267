"""Opening the authorizer's database, SQLite or PostgreSQL, and running transactions on it.

The engine setup, URL syntax and transaction discipline are shared with the monitor's
database (:mod:`agora_core.node.sql`): every transaction commits when its block ends, before the
store's method returns, so once a caller has been told something (a request id, a serial,
"this nonce is new"), a SIGKILL cannot take it back.
"""

from __future__ import annotations

from sqlalchemy.engine import URL

from agora_authorizer.store import schema
from agora_core.node import sql
from agora_core.node.sql import BUSY_TIMEOUT_S, SUPPORTED_URLS, DatabaseError

__all__ = [
    "BUSY_TIMEOUT_S",
    "SUPPORTED_URLS",
    "AlreadyExists",
    "Banned",
    "Database",
    "NotFound",
    "StoreError",
]


class StoreError(DatabaseError):
    """The database cannot be opened, reached or used, or a method names a bad record."""


class AlreadyExists(StoreError):
    """A record with that key exists already (an account name is taken)."""


class NotFound(StoreError):
    """A method names a record the store does not have (an unknown request id)."""


class Banned(StoreError):
    """A credential was not issued: its node or account is banned (``kind`` says which)."""

    def __init__(self, kind: str, target: str) -> None:
        self.kind = kind
        self.target = target
        super().__init__(f"{kind} {target} is banned")


def parse_url(url: str) -> tuple[URL, str, str]:
    """(engine URL, URL to display, backend) for a database URL or bare SQLite path;
    StoreError naming the supported forms for anything else."""
    return sql.parse_url(url, error=StoreError)


class Database(sql.SqlDatabase):
    """The authorizer's tables on one database (see :class:`agora_core.sql.SqlDatabase`).
    A database of a version in :data:`schema.UPGRADES_FROM` is upgraded as it is opened."""

    def __init__(self, url: str, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        super().__init__(
            url,
            metadata=schema.metadata,
            schema_info=schema.schema_info,
            schema_version=schema.SCHEMA_VERSION,
            what="authorizer",
            error=StoreError,
            driver_hint="pip install 'agora-authorizer[postgresql]'",
            busy_timeout_s=busy_timeout_s,
            upgrades_from=schema.UPGRADES_FROM,
        )
