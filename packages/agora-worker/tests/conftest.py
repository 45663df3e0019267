"""Fixtures the worker tests share: a DHT seed (in-process, or ``process_seed`` for worker
processes), in-process workers on real sockets, a client.

Each test module names its own ``DHT`` (seed timings), ``RUN`` (the default run config) and
``FAST`` (the default worker settings); the fixtures read them from the requesting module.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agora_core.config import RunConfig
from agora_core.dht import BlockingDht, DhtNode
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator
from agora_worker.worker import Worker


@pytest.fixture
async def seed(request):
    node = DhtNode(key=NodeKey.generate(), config=request.module.DHT)
    await node.start()
    yield node
    await node.stop()


@pytest.fixture(scope="module")
def process_seed(request):
    """A DHT seed for the module's worker processes, serving from its own thread (so blocking
    tests can read it too), with the module's ``DHT`` timings."""
    dht = BlockingDht(key=NodeKey.generate(), config=request.module.DHT, timeout_s=10.0)
    dht.start()
    try:
        yield dht
    finally:
        dht.stop()


@pytest.fixture
async def workers(request, seed):
    """``make(stage, run=RUN, link=None, **settings)`` starts a worker; all stop afterwards."""
    started: list[Worker] = []
    module = request.module

    async def make(
        stage: int, run: RunConfig | None = None, link: LinkConfig | None = None, **settings
    ) -> Worker:
        worker = Worker(
            run=run or module.RUN,
            stage=stage,
            key=NodeKey.generate(),
            bootstrap=[seed.address],
            settings=dataclasses.replace(module.FAST, **settings),
            link=LinkEmulator(link) if link else None,
        )
        started.append(worker)
        await worker.start()
        return worker

    yield make
    await asyncio.gather(*(w.stop(grace_s=1) for w in started), return_exceptions=True)


@pytest.fixture
async def client():
    cli = RpcClient()
    yield cli
    await cli.close()
