"""Streams: both directions at once, flow control, large tensors without unbounded buffering."""

from __future__ import annotations

import asyncio
import hashlib

import msgpack
import numpy as np
import pytest
import zmq

from agora_core.errors import BadRequest, DeadlineExceeded, StreamError
from agora_core.rpc import Payload, RpcClient, RpcConfig, RpcServer, receive_tensor, send_tensor
from agora_core.wire.message import PROTOCOL_VERSION
from agora_devkit.processes import wait_until_async

WINDOW = 4


@pytest.fixture
async def server():
    srv = RpcServer(config=RpcConfig(stream_window=WINDOW))
    await srv.start()
    yield srv
    await srv.stop()


@pytest.fixture
async def client():
    cli = RpcClient(config=RpcConfig(stream_window=WINDOW))
    yield cli
    await cli.close()


async def test_full_duplex_items_flow_both_ways_while_the_other_side_sends(server, client):
    async def doubler(stream):
        count = 0
        async for item in stream:  # answer each item while the client keeps sending
            await stream.send({"i": item.meta["i"]}, {"x": item.tensors["x"] * 2})
            count += 1
        return Payload({"count": count, "opened_with": stream.request.meta})

    server.register("doubler", doubler, stream=True)
    async with client.open_stream(server.address, "doubler", "hello") as stream:

        async def produce():
            for i in range(50):
                await stream.send({"i": i}, {"x": np.full(1000, i, dtype=np.float32)})
            await stream.end()

        producer = asyncio.create_task(produce())
        seen = []
        async for item in stream:
            assert item.tensors["x"][0] == 2 * item.meta["i"]
            seen.append(item.meta["i"])
        await producer
        result = await stream.result()
    assert seen == list(range(50))
    assert result.meta == {"count": 50, "opened_with": "hello"}


async def test_credit_rides_on_the_items_going_back(server, client):
    # A reducer returns one difference per chunk: the credit each side owes goes on the items
    # it sends anyway, so few credit messages are needed (one per two items without it).
    async def echo(stream):
        async for item in stream:
            await stream.send(item.meta, item.tensors)

    server.register("echo", echo, stream=True)
    items = 40
    server_in, client_in = server.traffic.messages_received, client.traffic.messages_received
    async with client.open_stream(server.address, "echo") as stream:

        async def send():
            for i in range(items):
                await stream.send(i, {"x": np.full(256, i, dtype=np.float32)})
            await stream.end()

        sender = asyncio.create_task(send())
        returned = [item.meta async for item in stream]
        await sender
        await stream.result()
    assert returned == list(range(items))
    credit_from_client = server.traffic.messages_received - server_in - (items + 2)  # + request, end
    credit_from_server = client.traffic.messages_received - client_in - (items + 2)  # + window, reply
    # Without it: one credit message per two items each way (2 * items / 2 in all).
    assert credit_from_client + credit_from_server <= items // 3


async def test_slow_consumer_never_buffers_more_than_the_window(server, client):
    observed = []
    consumer_gate = asyncio.Event()

    async def slow_sink(stream):
        await consumer_gate.wait()  # the sender runs ahead while the consumer is stalled
        total = 0
        async for item in stream:
            observed.append(stream.buffered)
            total += item.tensors["x"].size
        return Payload(total)

    server.register("slow_sink", slow_sink, stream=True)
    async with client.open_stream(server.address, "slow_sink") as stream:
        sender = asyncio.create_task(_send_many(stream, 40))
        # The sender stalls on credit after one window: it cannot have sent all 40 items.
        await wait_until_async(lambda: stream._credit == 0, what="sender to run out of credit")
        assert not sender.done()
        consumer_gate.set()
        await sender
        assert (await stream.result()).meta == 40 * 256
    assert max(observed) <= WINDOW


async def test_a_method_and_a_caller_can_set_their_own_stream_windows(server, client):
    gate = asyncio.Event()
    sent_back = []

    async def narrow(stream):  # registered with a window of 2: the caller may have 2 in flight
        await gate.wait()
        async for _ in stream:
            pass
        for i in range(6):  # the caller grants 3 at a time: this waits on it
            await stream.send({"i": i})
            sent_back.append(i)
        return Payload()

    server.register("narrow", narrow, stream=True, window=2)
    async with client.open_stream(server.address, "narrow", window=3) as stream:
        sent = []

        async def produce():
            for i in range(10):
                await stream.send(None, {"x": np.zeros(4, dtype=np.float32)})
                sent.append(i)
            await stream.end()

        sender = asyncio.create_task(produce())
        await wait_until_async(lambda: sent and stream._credit == 0, what="sender to spend its credit")
        assert len(sent) == 2 and not sender.done()  # the method's window, not the node's 4
        assert stream._granted == 3  # the caller's own window for the replies
        gate.set()
        await sender
        received = [item.meta["i"] async for item in stream]
        await stream.result()
    assert received == list(range(6)) == sent_back
    with pytest.raises(ValueError, match="window"):
        server.register("bad", narrow, window=2)  # not a streaming method
    with pytest.raises(ValueError, match="window"):
        async with client.open_stream(server.address, "narrow", window=0):
            pass


async def _send_many(stream, count):
    for _ in range(count):
        await stream.send(None, {"x": np.zeros(256, dtype=np.float32)})
    await stream.end()


async def test_sender_ignoring_credit_gets_a_stream_error(server):
    async def never_reads(stream):
        await asyncio.Event().wait()

    server.register("never_reads", never_reads, stream=True)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.address)
    try:
        open_call = {"v": list(PROTOCOL_VERSION), "kind": 1, "method": "never_reads", "id": 9, "credit": 4}
        dealer.send_multipart([msgpack.packb(open_call)])
        for _ in range(WINDOW + 3):  # more items than the server granted
            dealer.send_multipart([msgpack.packb({"v": list(PROTOCOL_VERSION), "kind": 4, "id": 9})])
        replies = []

        def got_error():
            while dealer.poll(0):
                replies.append(msgpack.unpackb(dealer.recv_multipart()[0]))
            return any(r["kind"] == 3 for r in replies)

        await wait_until_async(got_error, what="an error reply")
        error = next(r for r in replies if r["kind"] == 3)
        assert error["error"]["code"] == StreamError.code
        assert "credit" in error["error"]["message"]
        await wait_until_async(lambda: server.inflight == 0, what="the stream to be torn down")
    finally:
        dealer.close()


async def test_stream_errors_from_the_handler_reach_the_caller(server, client):
    async def refuses(stream):
        first = await stream.receive()
        raise BadRequest(f"cannot take {first.meta!r}")

    server.register("refuses", refuses, stream=True)
    async with client.open_stream(server.address, "refuses") as stream:
        await stream.send("this")
        with pytest.raises(BadRequest, match="cannot take 'this'"):
            await stream.result()
        with pytest.raises(BadRequest):
            await stream.receive()


async def test_stream_deadline_applies_to_a_stalled_peer(server, client):
    async def stalls(stream):
        await asyncio.Event().wait()

    server.register("stalls", stalls, stream=True)
    async with client.open_stream(server.address, "stalls", timeout_s=0.3) as stream:
        with pytest.raises(DeadlineExceeded):
            await stream.receive()


async def test_tensor_stream_rebuilds_in_process(server, client):
    async def sink(stream):
        tensor, meta = await receive_tensor(stream, max_bytes=1 << 24)
        return Payload({"sum": float(tensor.sum()), "shape": list(tensor.shape), "meta": meta})

    server.register("sink", sink, stream=True)
    tensor = np.arange(300_000, dtype=np.float64).reshape(600, 500)
    async with client.open_stream(server.address, "sink") as stream:
        sent = await send_tensor(stream, tensor, chunk_bytes=64 * 1024, meta={"tag": 1})
        result = await stream.result()
    assert sent == -(-tensor.nbytes // (64 * 1024))
    assert result.meta == {"sum": float(tensor.sum()), "shape": [600, 500], "meta": {"tag": 1}}


async def test_tensor_stream_over_the_receivers_limit_is_refused(server, client):
    async def small_sink(stream):
        await receive_tensor(stream, max_bytes=1024)

    server.register("small_sink", small_sink, stream=True)
    async with client.open_stream(server.address, "small_sink") as stream:
        with pytest.raises(BadRequest, match="exceeds the limit"):
            await send_tensor(stream, np.zeros(10_000), chunk_bytes=4096)
            await stream.result()


@pytest.mark.slow
async def test_256_mib_tensor_streams_to_another_process_with_bounded_memory(rpc_node):
    """The receiver holds the result plus a few chunks, not a second copy of the stream."""
    _node, address = rpc_node
    rng = np.random.default_rng(0)
    tensor = rng.integers(0, 256, size=256 << 20, dtype=np.uint8)  # incompressible
    rounds = 6  # the receiver hashes each chunk 6 times: far slower than the sender
    hasher = hashlib.sha256()
    for start in range(0, tensor.nbytes, 2 << 20):
        for _ in range(rounds):
            hasher.update(tensor[start : start + (2 << 20)])
    async with RpcClient() as client:
        async with client.open_stream(address, "sink", {"hash_rounds": rounds}, timeout_s=120) as stream:
            await send_tensor(stream, tensor, chunk_bytes=2 << 20)
            result = (await stream.result()).meta
    assert result["nbytes"] == tensor.nbytes
    assert result["sha256"] == hasher.hexdigest()
    assert result["max_buffered"] <= RpcConfig().stream_window
    # Result (256 MiB) + a window of 2 MiB chunks + zmq buffers; far below a second copy.
    assert result["rss_growth"] < tensor.nbytes + (64 << 20), f"grew {result['rss_growth'] / 2**20:.0f} MiB"
