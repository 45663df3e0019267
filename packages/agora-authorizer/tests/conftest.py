from __future__ import annotations

import pytest

from agora_authorizer.store import Store


@pytest.fixture
def store(db_url):
    """An open store on a fresh database of each backend (``db_url``: the repo's conftest)."""
    with Store.open(db_url) as store:
        yield store
