from __future__ import annotations

import contextlib
from pathlib import Path

import pytest

from agora_devkit.authority import TestAuthority
from agora_devkit.processes import spawn_python

RPC_NODE = str(Path(__file__).parent / "rpc_node.py")


@contextlib.contextmanager
def spawn_rpc_node(*args: str):
    """tests/rpc_node.py as its own OS process; yields (child, address); always stopped."""
    with spawn_python([RPC_NODE, *args]) as child:
        yield child, child.read_until("ADDRESS ")


@pytest.fixture(scope="module")
def authority() -> TestAuthority:
    """The authorizer key of an authorized test run, and what it signs."""
    return TestAuthority()


@pytest.fixture(scope="module")
def seed(authority, tmp_path_factory):
    """A real DHT node process of ``authority``'s run, holding a dht credential."""
    with authority.seed_process(tmp_path_factory.mktemp("seed")) as started:
        yield started


@pytest.fixture
def rpc_node():
    with spawn_rpc_node() as (child, address):
        yield child, address
