"""A real, throwaway PostgreSQL server for tests: the PostgreSQL backends (the authorizer's
store, the monitor's history) are tested against the server they will run on, not a mock.
It needs psycopg, a dev requirement (not a dependency of agora-core).

:func:`postgres_server` runs ``initdb`` in a temporary directory and starts the server on a
free port of 127.0.0.1 (its unix socket inside that directory, trust authentication, fsync
on as in production); it always stops the server and removes the directory, whatever
happened. :func:`create_database` gives each test a database of its own on it.

initdb refuses to run as root, so as root the server runs as the ``postgres`` system user
the Debian ``postgresql`` package creates.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql

from agora_devkit.processes import wait_until

DEBIAN_BIN_GLOB = "/usr/lib/postgresql/*/bin"
START_TIMEOUT_S = 60.0  # initdb and the first start are slow on a loaded machine
STOP_TIMEOUT_S = 30.0
SERVER_USER = "postgres"  # who runs the server when we are root
INSTALL_HINT = "install the Debian package `postgresql` (apt-get install -y postgresql)"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries here, or no way to run them (root without a postgres user)."""


def find_postgres_bin() -> Path:
    """The directory holding ``initdb`` and ``pg_ctl``: on PATH, else the newest Debian
    install under /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        directory = Path(on_path).resolve().parent
        if (directory / "pg_ctl").exists():
            return directory
    versions = sorted(
        (Path(p) for p in glob.glob(DEBIAN_BIN_GLOB) if (Path(p) / "initdb").exists()),
        key=lambda path: [int(part) for part in re.findall(r"\d+", path.parent.name)],
    )
    if versions:
        return versions[-1]
    raise PostgresUnavailable(
        f"PostgreSQL server binaries (initdb, pg_ctl) are not on PATH nor under {DEBIAN_BIN_GLOB}: "
        f"{INSTALL_HINT}"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _server_account() -> pwd.struct_passwd | None:
    """The account to run the server as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(SERVER_USER)
    except KeyError:
        raise PostgresUnavailable(
            f"running as root, which initdb refuses, and there is no {SERVER_USER!r} system user to "
            f"run the server as: {INSTALL_HINT} (it creates that user), or run the tests as another user"
        ) from None


def _can_connect(url: str) -> bool:
    try:
        psycopg.connect(url, connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True


@contextlib.contextmanager
def postgres_server(*, start_timeout_s: float = START_TIMEOUT_S) -> Iterator[str]:
    """Start a throwaway server; yields its URL ``postgresql://postgres@127.0.0.1:PORT/postgres``.

    The server is stopped (``pg_ctl stop -m immediate``, then SIGKILL of its postmaster if
    that fails) and its directory removed when the block exits, however it exits."""
    server = _Server(find_postgres_bin(), _server_account(), start_timeout_s)
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(server.root, ignore_errors=True)


class _Server:
    """One server's directory (data, log, unix socket) and the commands run on it."""

    def __init__(self, bin_dir: Path, account: pwd.struct_passwd | None, timeout_s: float) -> None:
        self.bin_dir = bin_dir
        self.timeout_s = timeout_s
        self.root = Path(tempfile.mkdtemp(prefix="agora-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self._as: dict = {"cwd": self.root}  # the server user may not be able to enter our cwd
        if account is not None:
            os.chown(self.root, account.pw_uid, account.pw_gid)
            self._as.update(user=account.pw_uid, group=account.pw_gid, extra_groups=[])

    def _run(self, tool: str, *args: str | Path) -> None:
        command = [str(self.bin_dir / tool), *map(str, args)]
        result = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout_s, **self._as)
        if result.returncode != 0:
            raise PostgresUnavailable(f"{tool} failed ({result.returncode}): {result.stderr.strip()}")

    def start(self) -> str:
        """initdb, then start on a free port; the URL once it takes connections. A port taken
        between probing and binding costs a retry on another."""
        self._run("initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-locale")
        conf = self.data / "postgresql.conf"
        original = conf.read_text()
        for attempt in range(3):
            port = _free_port()
            settings = {
                "listen_addresses": "'127.0.0.1'",  # never reachable from another machine
                "port": str(port),
                "unix_socket_directories": f"'{self.root}'",  # /var/run/postgresql may be absent
                "fsync": "on",  # as in production: the SIGKILL tests rely on what fsync promises
            }
            conf.write_text(original + "".join(f"{key} = {value}\n" for key, value in settings.items()))
            try:  # -w: pg_ctl returns once the server is up, or fails at once if it died
                self._run("pg_ctl", "start", "-D", self.data, "-l", self.log, "-w", "-t", int(self.timeout_s))
            except PostgresUnavailable:
                if attempt < 2:
                    continue
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else "(no log)"
                raise PostgresUnavailable(f"the test server did not start:\n{tail}") from None
            url = f"postgresql://postgres@127.0.0.1:{port}/postgres"
            ready = functools.partial(_can_connect, url)
            wait_until(ready, timeout_s=self.timeout_s, every_s=0.05, what=f"postgres on port {port}")
            return url
        raise AssertionError("unreachable")

    def stop(self) -> None:
        pid_file = self.data / "postmaster.pid"
        if not pid_file.exists():
            return  # never started, or already gone
        with contextlib.suppress(PostgresUnavailable, subprocess.TimeoutExpired):
            self._run("pg_ctl", "stop", "-D", self.data, "-m", "immediate", "-w", "-t", int(STOP_TIMEOUT_S))
            return
        with contextlib.suppress(OSError, ValueError, IndexError):  # the postmaster start() began
            os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)


def create_database(server_url: str) -> str:
    """A new, empty database on the server at ``server_url``; returns its URL."""
    name = f"agora_test_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(server_url, autocommit=True, connect_timeout=10) as connection:
        connection.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return server_url.rsplit("/", 1)[0] + "/" + name
