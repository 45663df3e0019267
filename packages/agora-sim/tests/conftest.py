from __future__ import annotations

import pytest

from agora_devkit.authority import TestAuthority


@pytest.fixture(scope="module")
def authority() -> TestAuthority:
    """The authorizer key of a simulated authorized run, and what it signs."""
    return TestAuthority()
