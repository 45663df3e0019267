"""RPC over real ZeroMQ sockets on 127.0.0.1: calls, concurrency, deadlines, typed errors."""

from __future__ import annotations

import asyncio
import socket
import time

import msgpack
import numpy as np
import pytest
import zmq

from agora_core.errors import (
    BadRequest,
    DeadlineExceeded,
    HandlerFailed,
    Overloaded,
    PeerUnreachable,
    UnknownMethod,
)
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, RpcClient, RpcConfig, RpcServer
from agora_core.wire.dtypes import SUPPORTED_DTYPES, TaggedArray, storage_dtype
from agora_core.wire.message import PROTOCOL_VERSION
from agora_devkit.processes import wait_until_async as wait_until


def raw_dealer(address: str) -> zmq.Socket:
    """A hand-rolled peer that speaks the wire protocol directly (or breaks it)."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    return dealer


async def raw_reply(dealer: zmq.Socket, timeout_s: float = 10.0) -> dict:
    await wait_until(lambda: dealer.poll(0), timeout_s=timeout_s, what="a reply")
    return msgpack.unpackb(dealer.recv_multipart()[0])


@pytest.fixture
async def server():
    srv = RpcServer(metrics=NodeMetrics(role="test"))

    async def echo(request):
        return Payload(request.meta, request.tensors)

    srv.register("echo", echo)
    await srv.start()
    yield srv
    await srv.stop()


class Hang:
    """A handler that waits until cancelled, recording that it started and was cancelled."""

    def __init__(self):
        self.started, self.cancelled = asyncio.Event(), asyncio.Event()

    async def __call__(self, request):
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
def slow(server):
    handler = Hang()
    server.register("slow", handler)
    return handler


@pytest.fixture
async def client():
    cli = RpcClient(config=RpcConfig(connect_timeout_s=2.0))
    yield cli
    await cli.close()


async def test_every_dtype_survives_a_call(server, client):
    rng = np.random.default_rng(0)
    tensors = {}
    for dtype in SUPPORTED_DTYPES:
        storage = storage_dtype(dtype)
        words = rng.integers(0, 256, 60 * storage.itemsize, dtype=np.uint8).view(storage).reshape(3, 20)
        tensors[dtype] = TaggedArray(dtype, words) if dtype == "bfloat16" else words
    tensors["0d"] = np.array(7, dtype=np.int64)
    tensors["empty"] = np.zeros((2, 0), dtype=np.float32)
    tensors["strided"] = np.arange(100, dtype=np.float64).reshape(10, 10)[::3, 1::2]
    reply = await client.call(server.address, "echo", {"k": "v"}, tensors)
    assert reply.meta == {"k": "v"}
    for name, sent in tensors.items():
        got = reply.tensors[name]
        if isinstance(sent, TaggedArray):
            assert got == sent
        else:
            assert got.shape == sent.shape and got.dtype == sent.dtype
            assert got.tobytes() == np.ascontiguousarray(sent).tobytes()


async def test_sixteen_clients_with_200_concurrent_calls_each_get_their_own_answers(server):
    clients = [RpcClient() for _ in range(16)]
    try:

        async def one(c: int, i: int):
            vector = np.full(8, c * 1000 + i, dtype=np.int64)
            reply = await client_call(clients[c], server.address, {"c": c, "i": i}, vector)
            assert reply.meta == {"c": c, "i": i}
            assert reply.tensors["v"].tolist() == vector.tolist()
            return 1

        async def client_call(cli, address, meta, vector):
            return await cli.call(address, "echo", meta, {"v": vector}, timeout_s=60)

        results = await asyncio.gather(*(one(c, i) for c in range(16) for i in range(200)))
        assert sum(results) == 3200
    finally:
        await asyncio.gather(*(c.close() for c in clients))


async def test_connection_is_reused_across_calls(server, client):
    for _ in range(5):
        await client.call(server.address, "echo")
    assert client.connections == 1


async def test_unknown_method_names_what_the_server_serves(server, client):
    with pytest.raises(UnknownMethod, match=r"'nope'.*echo") as info:
        await client.call(server.address, "nope")
    assert info.value.remote


async def test_handler_errors_arrive_typed_with_the_remote_message(server, client):
    async def picky(request):
        if request.meta != "ok":
            raise BadRequest(f"meta must be 'ok', got {request.meta!r}")
        raise ValueError("the handler broke")

    server.register("picky", picky)
    with pytest.raises(BadRequest, match="meta must be 'ok', got 3"):
        await client.call(server.address, "picky", 3)
    with pytest.raises(HandlerFailed, match="ValueError: the handler broke"):
        await client.call(server.address, "picky", "ok")
    # the server still serves
    assert (await client.call(server.address, "echo", 1)).meta == 1


async def test_plain_function_handlers_answer_on_the_receive_path_with_the_same_errors(client):
    metrics = NodeMetrics(role="test", instance="inline")
    srv = RpcServer(metrics=metrics)
    seen = []

    def lookup(request):  # a plain function: no task, its reply goes out at once
        seen.append(request.meta)
        if request.meta == "bad":
            raise BadRequest("no such key")
        if request.meta == "bug":
            raise KeyError("oops")
        if request.meta == "wrong":
            return {"not": "a payload"}
        return Payload({"found": request.meta}) if request.meta is not None else None

    async def later(request):  # suspends once (on a reply of its own), so a task must finish it
        return Payload((await client.call(srv.address, "lookup", "later")).meta["found"])

    srv.register("lookup", lookup)
    srv.register("deferred", lambda request: later(request))  # returns a coroutine: run as a task
    await srv.start()
    try:
        replies = await asyncio.gather(*(client.call(srv.address, "lookup", i) for i in range(50)))
        assert [r.meta for r in replies] == [{"found": i} for i in range(50)]
        assert (await client.call(srv.address, "lookup")).meta is None  # None: an empty Payload
        with pytest.raises(BadRequest, match="no such key"):
            await client.call(srv.address, "lookup", "bad")
        with pytest.raises(HandlerFailed, match="KeyError"):
            await client.call(srv.address, "lookup", "bug")
        with pytest.raises(HandlerFailed, match="expected Payload or None"):
            await client.call(srv.address, "lookup", "wrong")
        assert (await client.call(srv.address, "deferred")).meta == "later"
        assert srv.inflight == 0  # nothing of the inline calls is left behind
        ok = metrics.sample_value("agora_rpc_requests_total", {"method": "lookup", "outcome": "ok"})
        failed = metrics.sample_value(
            "agora_rpc_requests_total", {"method": "lookup", "outcome": "bad_request"}
        )
        timed = metrics.sample_value("agora_rpc_handler_seconds_count", {"method": "lookup"})
        assert (ok, failed, timed) == (52, 1, 55)  # the deferred handler made one lookup too
        assert b'agora_rpc_handler_seconds_bucket{instance="inline"' in metrics.exposition()
    finally:
        await srv.stop()


async def test_deadline_exceeded_on_client_and_handler_cancelled_on_server(server, client, slow):
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        await client.call(server.address, "slow", timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
    await asyncio.wait_for(slow.cancelled.wait(), 5)
    await wait_until(lambda: server.inflight == 0, what="server to forget the call")


async def test_server_enforces_the_callers_deadline_by_itself(server, slow):
    dealer = raw_dealer(server.address)  # a caller that never cancels: only the deadline acts
    try:
        header = {"v": list(PROTOCOL_VERSION), "kind": 1, "method": "slow", "id": 5, "deadline_s": 0.2}
        t0 = time.monotonic()
        dealer.send_multipart([msgpack.packb(header)])
        reply = await raw_reply(dealer)
        assert reply["id"] == 5 and reply["error"]["code"] == "deadline_exceeded"
        assert time.monotonic() - t0 >= 0.15
        assert slow.cancelled.is_set()
    finally:
        dealer.close()


async def test_cancelling_the_caller_cancels_the_remote_handler(server, client, slow):
    task = asyncio.create_task(client.call(server.address, "slow", timeout_s=30))
    await asyncio.wait_for(slow.started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(slow.cancelled.wait(), 5)
    assert (await client.call(server.address, "echo", "still here")).meta == "still here"


async def test_nobody_listening_is_peer_unreachable_quickly(client):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # a port with no listener once the socket closes
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match=r"could not connect|no connection"):
        await client.call(f"127.0.0.1:{port}", "echo", timeout_s=30)
    assert time.monotonic() - t0 < 2  # refused: no need to wait for the connect timeout


async def test_a_short_call_leaves_a_connection_being_set_up_to_the_next_one():
    # a listener that takes the TCP connection and never speaks ZMTP: forever connecting
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    cli = RpcClient(config=RpcConfig(connect_timeout_s=1.0))
    try:
        started = time.monotonic()
        with pytest.raises(PeerUnreachable, match="still connecting"):
            await cli.call(address, "echo", timeout_s=0.2)
        assert cli.connections == 1  # the attempt goes on: a probe-sized call must not restart it
        with pytest.raises(PeerUnreachable, match=r"within 1\.00 s"):
            await cli.call(address, "echo", timeout_s=10.0)
        assert cli.connections == 0 and time.monotonic() - started < 5.0  # the connect timeout, not 10 s
    finally:
        await cli.close()
        listener.close()


async def test_peer_killed_mid_call_is_peer_unreachable_not_a_full_timeout(client, rpc_node):
    node, address = rpc_node
    assert (await client.call(address, "echo", "up")).meta == "up"
    call = asyncio.create_task(client.call(address, "hang", timeout_s=60))
    await wait_until(lambda: any(p.pending for p in client._peers.values()), what="call pending")
    node.kill()
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable, match="lost"):
        await call
    assert time.monotonic() - t0 < 15


async def test_overloaded_server_refuses_instead_of_queueing_without_bound(client):
    srv = RpcServer(config=RpcConfig(max_inflight_requests=4))
    gate = asyncio.Event()

    async def held(request):
        await gate.wait()

    srv.register("held", held)
    await srv.start()
    try:
        calls = [asyncio.create_task(client.call(srv.address, "held", timeout_s=30)) for _ in range(4)]
        await wait_until(lambda: srv.inflight == 4, what="4 calls in flight")
        with pytest.raises(Overloaded):
            await client.call(srv.address, "held", timeout_s=30)
        gate.set()
        await asyncio.gather(*calls)
    finally:
        await srv.stop()


async def test_malformed_request_with_an_id_gets_a_bad_request_reply(server):
    dealer = raw_dealer(server.address)  # declares a tensor but sends no data frame
    try:
        header = {
            "v": list(PROTOCOL_VERSION),
            "kind": 1,
            "method": "echo",
            "id": 42,
            "tensors": [
                {
                    "name": "x",
                    "dtype": "float32",
                    "shape": [4],
                    "chunk_bytes": 4096,
                    "chunks": 1,
                    "codecs": [0],
                    "sizes": [16],
                }
            ],
        }
        dealer.send_multipart([msgpack.packb(header)])
        reply = await raw_reply(dealer)
        assert reply["id"] == 42 and reply["kind"] == 3
        assert reply["error"]["code"] == "bad_request"
        assert "data frames" in reply["error"]["message"]
    finally:
        dealer.close()


async def test_duplicate_registration_and_bad_timeouts_are_refused(server, client):
    with pytest.raises(ValueError, match="already registered"):
        server.register("echo", lambda r: None)
    with pytest.raises(ValueError, match="positive"):
        await client.call(server.address, "echo", timeout_s=0)


async def test_server_metrics_count_requests_and_rejections(client):
    metrics = NodeMetrics(role="test", instance="m")
    srv = RpcServer(metrics=metrics)

    async def echo(request):
        return Payload(request.meta)

    srv.register("echo", echo)
    await srv.start()
    try:
        await client.call(srv.address, "echo")
        with pytest.raises(UnknownMethod):
            await client.call(srv.address, "missing")
        ok = metrics.sample_value("agora_rpc_requests_total", {"method": "echo", "outcome": "ok"})
        unknown = metrics.sample_value("agora_rpc_rejected_messages_total", {"reason": "unknown_method"})
        assert ok == 1 and unknown == 1
    finally:
        await srv.stop()


async def test_idle_connections_beyond_the_pool_size_are_closed():
    servers = []
    for _ in range(4):
        srv = RpcServer()
        srv.register("echo", _echo)
        await srv.start()
        servers.append(srv)
    try:
        async with RpcClient(config=RpcConfig(max_connections=2)) as client:
            for _ in range(2):
                for srv in servers:
                    assert (await client.call(srv.address, "echo", srv.address)).meta == srv.address
                    assert client.connections <= 2
    finally:
        for srv in servers:
            await srv.stop()


async def _echo(request):
    return Payload(request.meta)


async def test_a_restarted_peer_is_reachable_again_at_the_same_address(client):
    first = RpcServer()
    first.register("echo", _echo)
    address = await first.start()
    assert (await client.call(address, "echo", 1)).meta == 1
    await first.stop()
    await wait_until(lambda: client.connections == 0, what="the client to notice the loss")
    second = RpcServer(listen=address.removeprefix("tcp://"))
    second.register("echo", _echo)
    await second.start()
    try:
        assert (await client.call(address, "echo", 2)).meta == 2
    finally:
        await second.stop()
