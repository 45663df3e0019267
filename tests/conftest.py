"""Fixtures of the whole-system tests: a local swarm driven through `tools/swarm.py`."""

from __future__ import annotations

from pathlib import Path

import pytest

from agora_devkit.swarm import Swarm, make_swarm_config, make_swarm_shards


@pytest.fixture(scope="session")
def swarm_shards(tmp_path_factory) -> Path:
    """Data shards every swarm test trains on (made once per session)."""
    return make_swarm_shards(tmp_path_factory.mktemp("shards"))


@pytest.fixture
def swarm_config(tmp_path) -> Path:
    return make_swarm_config(tmp_path)


@pytest.fixture
def swarm_factory(tmp_path):
    """Start swarms with ``start(config, shards, samples, export=False)``; each is stopped
    after the test, however it ended."""
    started: list[Swarm] = []

    def start(config: Path, shards: Path, samples: int, *, export: bool = False) -> Swarm:
        swarm = Swarm(config, shards, tmp_path / "run", samples, export)
        started.append(swarm)
        return swarm

    yield start
    for swarm in started:
        swarm.stop()
