"""Shared by every test in the repo."""

from __future__ import annotations

import pytest

from agora_core.logs import configure_logging


@pytest.fixture(scope="session", autouse=True)
def quiet_logs():
    """Nodes log their lifecycle at info; in tests only warnings are worth reading."""
    configure_logging(fmt="console", level="warning")
