"""Link emulation inside the transport: lower bounds on delay and transfer time."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator


async def echo(request):
    return Payload(request.meta, request.tensors)


async def timed_call(client, address, **kwargs) -> float:
    t0 = time.perf_counter()
    await client.call(address, "echo", **kwargs)
    return time.perf_counter() - t0


async def test_latency_delays_every_round_trip():
    # 40 ms one way on the server's link: a round trip crosses it twice.
    server = RpcServer(link=LinkEmulator(LinkConfig(latency_s=0.04)))
    server.register("echo", echo)
    await server.start()
    try:
        async with RpcClient() as client:
            await client.call(server.address, "echo")
            rtts = [await timed_call(client, server.address) for _ in range(5)]
        assert min(rtts) >= 0.08
    finally:
        await server.stop()


async def test_upload_bandwidth_throttles_large_replies():
    rate = 40e6  # 40 Mbit/s up from the server
    server = RpcServer(link=LinkEmulator(LinkConfig(up_bits_per_s=rate)))
    server.register("echo", echo)
    await server.start()
    payload = np.random.default_rng(0).random(1 << 18)  # 2 MiB of incompressible float64
    try:
        async with RpcClient() as client:
            elapsed = await timed_call(client, server.address, tensors={"x": payload})
        assert elapsed >= payload.nbytes * 8 / rate * 0.95  # >= 0.42 s
    finally:
        await server.stop()


async def test_download_bandwidth_and_client_side_link_apply_too():
    rate = 40e6
    server = RpcServer()
    server.register("echo", echo)
    await server.start()
    payload = np.random.default_rng(1).random(1 << 17)  # 1 MiB each way
    try:
        link = LinkEmulator(LinkConfig(down_bits_per_s=rate, latency_s=0.01))
        async with RpcClient(link=link) as shaped, RpcClient() as ideal:
            shaped_s = await timed_call(shaped, server.address, tensors={"x": payload})
            ideal_s = await timed_call(ideal, server.address, tensors={"x": payload})
        # the reply crosses the 40 Mbit/s download; latency applies out and back
        assert shaped_s >= payload.nbytes * 8 / rate + 0.02 * 0.95
        assert shaped_s > ideal_s
    finally:
        await server.stop()


async def test_messages_keep_their_order_under_jitter():
    server = RpcServer(link=LinkEmulator(LinkConfig(latency_s=0.01, jitter_s=0.01, seed=3)))
    order = []

    async def record(request):
        order.append(request.meta)

    server.register("record", record)
    await server.start()
    try:
        async with RpcClient(
            link=LinkEmulator(LinkConfig(latency_s=0.005, jitter_s=0.005, seed=4))
        ) as client:
            await asyncio.gather(*(client.call(server.address, "record", i) for i in range(30)))
        assert order == list(range(30))
    finally:
        await server.stop()


def test_link_spec_parsing():
    config = LinkConfig.parse("up=200M, down=50Mbit/s, latency=40ms, jitter=0.005s")
    assert config.up_bits_per_s == 200e6 and config.down_bits_per_s == 50e6
    assert config.latency_s == pytest.approx(0.04) and config.jitter_s == pytest.approx(0.005)
    assert LinkConfig.parse("").is_ideal
    for bad in ("up", "speed=1M", "up=-5M", "latency=-1ms"):
        with pytest.raises(ValueError):
            LinkConfig.parse(bad)
