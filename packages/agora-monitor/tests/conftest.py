from __future__ import annotations

import pytest

from agora_core.testing_postgres import create_database, postgres_server


@pytest.fixture(scope="session")
def postgres_url():
    """One throwaway PostgreSQL server for the session. Not installed: the fixture fails
    with what to install (tools/dev.py test installs it), it does not skip."""
    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database of each backend: a SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'monitor.db'}"
    return create_database(request.getfixturevalue("postgres_url"))
