"""Shared by every test in the repo."""

from __future__ import annotations

import pytest

from agora_core.observability.logs import configure_logging
from agora_devkit.postgres import create_database, postgres_server
from agora_devkit.prometheus import pushgateway_process


@pytest.fixture(scope="session", autouse=True)
def quiet_logs():
    """Nodes log their lifecycle at info; in tests only warnings are worth reading."""
    configure_logging(fmt="console", level="warning")


@pytest.fixture(scope="session")
def postgres_url():
    """One throwaway PostgreSQL server for the session, shared by every store's tests. Not
    installed: the fixture fails with what to install (tools/dev.py test installs it)."""
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database of each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'test.db'}"
    return create_database(request.getfixturevalue("postgres_url"))


@pytest.fixture(scope="module")
def gateway():
    """A real Prometheus push gateway on a free loopback port, stopped after the module."""
    with pushgateway_process() as running:
        yield running
