"""Opening a role's database, SQLite or PostgreSQL, and running transactions on it.

Shared by the roles that keep a database (the authorizer's store, the monitor's history):
one URL syntax, one engine setup per backend, one transaction discipline, one schema-version
check. SQLAlchemy is imported here, so only packages that depend on it import this module
(agora-core itself does not: ``pip install 'agora-core[sql]'``).

Every transaction commits when its block ends. SQLite runs in WAL mode with
``synchronous=FULL``, so a commit is on disk when it returns, and with a busy timeout, so
another process (a CLI, a dashboard) can use the file while the service holds it. Write
transactions on SQLite begin ``IMMEDIATE``: they take the write lock up front, so a
read-then-write never fails halfway on a snapshot another process moved past. PostgreSQL runs
at its default isolation (read committed).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import MetaData, Table, event, exc, func, insert, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import URL, Connection, make_url

from agora_core.errors import AgoraError

BUSY_TIMEOUT_S = 30.0  # how long a SQLite writer waits for another process's transaction
CONNECT_TIMEOUT_S = 10  # PostgreSQL: how long opening a connection may take
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")  # a bare path with one of these is a SQLite file
SUPPORTED_URLS = (
    "sqlite:///path/to/file.db, a path ending in .db or .sqlite, "
    "or postgresql://user[:password]@host[:port]/database"
)
_CREATE_LOCK = 0x61676F7261  # PostgreSQL advisory lock key ("agora") held while creating tables


class DatabaseError(AgoraError):
    """The database cannot be opened, reached or used (a bad URL, a server that does not answer)."""


def parse_url(url: str, *, error: type[DatabaseError] = DatabaseError) -> tuple[URL, str, str]:
    """(the URL the engine connects to, the URL to display with any password masked, the
    backend name) for a database URL or bare SQLite path; ``error`` naming the supported
    forms for anything else."""
    if not isinstance(url, str) or not url:
        raise error(f"no database given: use {SUPPORTED_URLS}")
    if "://" not in url and Path(url).suffix.lower() in SQLITE_SUFFIXES:
        parsed = URL.create("sqlite", database=str(Path(url).expanduser().absolute()))
        return parsed, parsed.render_as_string(hide_password=True), "sqlite"
    try:
        given = make_url(url)
    except exc.ArgumentError:
        raise error(f"not a database URL: {url!r}; use {SUPPORTED_URLS}") from None
    shown = given.render_as_string(hide_password=True)
    if given.drivername in ("sqlite", "sqlite+pysqlite"):
        if given.database in (None, "", ":memory:"):
            raise error(f"{shown} is an in-memory database, which keeps nothing: give a file path")
        return given.set(drivername="sqlite"), shown, "sqlite"
    if given.drivername in ("postgresql", "postgresql+psycopg"):
        return given.set(drivername="postgresql+psycopg"), shown, "postgresql"
    raise error(f"unsupported database {shown}: use {SUPPORTED_URLS}")


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


def _postgresql_engine(url: URL, shown: str, driver_hint: str, error: type[DatabaseError]) -> sa.Engine:
    try:
        import psycopg  # noqa: F401 - the driver is an optional dependency
    except ModuleNotFoundError:
        raise error(f"{shown} needs the psycopg driver: {driver_hint}") from None
    # pre-ping: a pooled connection the server dropped (a restart) is replaced, not reported
    return sa.create_engine(url, pool_pre_ping=True, connect_args={"connect_timeout": CONNECT_TIMEOUT_S})


class SqlDatabase:
    """One engine on one database: transactions, the dialect's upsert, the schema check.

    ``metadata`` holds the role's tables, among them ``schema_info`` (one ``version``
    column); a database written under another ``schema_version`` is refused, naming ``what``
    reads it, except one of a version in ``upgrades_from``, which lacks only tables added
    since: they are created and its version moved on as it is opened, in one transaction.
    Errors are raised as ``error`` (a role's own subclass of DatabaseError)."""

    def __init__(
        self,
        url: str,
        *,
        metadata: MetaData,
        schema_info: Table,
        schema_version: int,
        what: str,
        error: type[DatabaseError] = DatabaseError,
        driver_hint: str = "pip install 'psycopg[binary]'",
        busy_timeout_s: float = BUSY_TIMEOUT_S,
        upgrades_from: tuple[int, ...] = (),
    ) -> None:
        self._error = error
        engine_url, self.url, self.backend = parse_url(url, error=error)
        if self.backend == "sqlite":
            self._engine = _sqlite_engine(engine_url, busy_timeout_s)
        else:
            self._engine = _postgresql_engine(engine_url, self.url, driver_hint, error)
        self.upsert = sqlite.insert if self.backend == "sqlite" else postgresql.insert
        self._closed = False
        self._upgrades_from = upgrades_from
        try:
            self._create_tables(metadata, schema_info, schema_version, what)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._closed = True
        self._engine.dispose()

    @contextlib.contextmanager
    def transaction(self, *, write: bool = False) -> Iterator[Connection]:
        """One transaction, committed when the block ends, rolled back if it raises. Database
        failures become the role's error; IntegrityError passes through for the caller to judge."""
        if self._closed:
            raise self._error(f"the store {self.url} is closed")
        try:
            with self._engine.connect() as connection:
                connection.execution_options(agora_write=write)
                with connection.begin():
                    yield connection
        except exc.IntegrityError:
            raise
        except exc.DBAPIError as error:
            raise self._error(f"database {self.url}: {error.orig}") from error

    def _create_tables(self, metadata: MetaData, schema_info: Table, version: int, what: str) -> None:
        with self.transaction(write=True) as connection:
            if self.backend == "postgresql":  # two processes opening a new database take turns
                connection.execute(select(func.pg_advisory_xact_lock(_CREATE_LOCK)))
            if self._upgrades_from and connection.dialect.has_table(connection, schema_info.name):
                versions = connection.scalars(select(schema_info.c.version)).all()
                if len(versions) == 1 and versions[0] in self._upgrades_from:
                    metadata.create_all(connection)
                    connection.execute(update(schema_info).values(version=version))
            metadata.create_all(connection)
            versions = connection.scalars(select(schema_info.c.version)).all()
            if not versions:
                connection.execute(insert(schema_info).values(version=version))
            elif versions != [version]:
                raise self._error(
                    f"{self.url} holds {what} schema version {versions}; this {what} reads version {version}"
                )
