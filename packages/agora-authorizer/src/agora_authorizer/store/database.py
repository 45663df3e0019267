"""Opening the authorizer's database, SQLite or PostgreSQL, and running transactions on it.

Every transaction commits when its block ends, before the store's method returns: once a
caller has been told something (a request id, a serial, "this nonce is new"), a SIGKILL
cannot take it back. SQLite runs in WAL mode with ``synchronous=FULL``, so a commit is on
disk when it returns, and with a busy timeout, so the CLI (``ban``, ``status``) can use the
file while the service holds it. Write transactions on SQLite begin ``IMMEDIATE``: they take
the write lock up front, so a read-then-write never fails halfway on a snapshot another
process moved past. PostgreSQL runs at its default isolation (read committed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event, exc, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url

from agora_authorizer.store import schema
from agora_core.errors import AgoraError

BUSY_TIMEOUT_S = 30.0  # how long a SQLite writer waits for another process's transaction
CONNECT_TIMEOUT_S = 10  # PostgreSQL: how long opening a connection may take
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")  # a bare path with one of these is a SQLite file
SUPPORTED_URLS = (
    "sqlite:///path/to/file.db, a path ending in .db or .sqlite, "
    "or postgresql://user[:password]@host[:port]/database"
)
_CREATE_LOCK = 0x61676F7261  # PostgreSQL advisory lock key ("agora") held while creating tables


class StoreError(AgoraError):
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
    """(the URL the engine connects to, the URL to display with any password masked, the
    backend name) for a database URL or bare SQLite path; StoreError naming the supported
    forms for anything else."""
    if not isinstance(url, str) or not url:
        raise StoreError(f"no database given: use {SUPPORTED_URLS}")
    if "://" not in url and Path(url).suffix.lower() in SQLITE_SUFFIXES:
        parsed = URL.create("sqlite", database=str(Path(url).expanduser().absolute()))
        return parsed, parsed.render_as_string(hide_password=True), "sqlite"
    try:
        given = make_url(url)
    except exc.ArgumentError:
        raise StoreError(f"not a database URL: {url!r}; use {SUPPORTED_URLS}") from None
    shown = given.render_as_string(hide_password=True)
    if given.drivername in ("sqlite", "sqlite+pysqlite"):
        if given.database in (None, "", ":memory:"):
            raise StoreError(f"{shown} is an in-memory database, which keeps nothing: give a file path")
        return given.set(drivername="sqlite"), shown, "sqlite"
    if given.drivername in ("postgresql", "postgresql+psycopg"):
        return given.set(drivername="postgresql+psycopg"), shown, "postgresql"
    raise StoreError(f"unsupported database {shown}: use {SUPPORTED_URLS}")


def _sqlite_engine(url: URL, busy_timeout_s: float) -> sa.Engine:
    engine = sa.create_engine(url)

    @event.listens_for(engine, "connect")
    def on_connect(dbapi_connection, connection_record) -> None:
        dbapi_connection.isolation_level = None  # the driver emits no BEGIN; on_begin below does
        cursor = dbapi_connection.cursor()
        for pragma in (
            f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}",  # first: the others may wait
            "PRAGMA journal_mode = WAL",  # readers and one writer at once, across processes
            "PRAGMA synchronous = FULL",  # fsync the WAL at every commit: committed is on disk
            "PRAGMA foreign_keys = ON",
        ):
            cursor.execute(pragma)
        cursor.close()

    @event.listens_for(engine, "begin")
    def on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get("agora_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _postgresql_engine(url: URL, shown: str) -> sa.Engine:
    try:
        import psycopg  # noqa: F401 - the driver is an optional dependency
    except ModuleNotFoundError:
        raise StoreError(
            f"{shown} needs the psycopg driver: pip install 'agora-authorizer[postgresql]'"
        ) from None
    # pre-ping: a pooled connection the server dropped (a restart) is replaced, not reported
    return sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


class Database:
    """One engine on one database: transactions, the dialect's upsert, the schema check."""

    def __init__(self, url: str, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        engine_url, self.url, self.backend = parse_url(url)
        if self.backend == "sqlite":
            self._engine = _sqlite_engine(engine_url, busy_timeout_s)
        else:
            self._engine = _postgresql_engine(engine_url, self.url)
        self.upsert = sqlite.insert if self.backend == "sqlite" else postgresql.insert
        self._closed = False
        try:
            self._create_tables()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._closed = True
        self._engine.dispose()

    @contextlib.contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[Connection]:
        """One transaction, committed when the block ends, rolled back if it raises. Database
        failures become StoreError; IntegrityError passes through for the caller to judge."""
        if self._closed:
            raise StoreError(f"the store {self.url} is closed")
        try:
            with self._engine.connect() as connection:
                connection.execution_options(agora_write=write)
                with connection.begin():
                    yield connection
        except exc.IntegrityError:
            raise
        except exc.DBAPIError as error:
            raise StoreError(f"database {self.url}: {error.orig}") from error

    def _create_tables(self) -> None:
        with self.transaction(write=True) as connection:
            if self.backend == "postgresql":  # two processes opening a new database take turns
                connection.execute(select(func.pg_advisory_xact_lock(_CREATE_LOCK)))
            schema.metadata.create_all(connection)
            versions = connection.scalars(select(schema.schema_info.c.version)).all()
            if not versions:
                connection.execute(insert(schema.schema_info).values(version=schema.SCHEMA_VERSION))
            elif versions != [schema.SCHEMA_VERSION]:
                raise StoreError(
                    f"{self.url} holds authorizer schema version {versions}; "
                    f"this authorizer reads version {schema.SCHEMA_VERSION}"
                )
