"""Fuzz a live server in its own process with random, truncated and oversized messages.

Afterwards it must still answer a normal request, must have counted what it rejected, and its
memory must not have ballooned.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agora_core.rpc import RpcClient
from agora_core.testing import spawn_python
from agora_core.wire import Kind, Message, WireConfig, encode

MAX_MESSAGE_BYTES = 1 << 20  # the fuzzed node's limit: 1 MiB per message
RPC_NODE = str(Path(__file__).parent / "rpc_node.py")

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def valid_request(request_id: int) -> list[bytes]:
    tensors = {"x": np.arange(64, dtype=np.float32), "z": np.zeros(8192, dtype=np.float32)}
    frames = encode(
        Message(kind=Kind.REQUEST, method="echo", request_id=request_id, deadline_s=5.0, tensors=tensors),
        WireConfig(chunk_bytes=4096),
    )
    return [bytes(f) for f in frames]


@st.composite
def hostile_messages(draw) -> list[bytes]:
    """Garbage, or a valid request with its header or frames damaged."""
    choice = draw(st.sampled_from(["garbage", "header_field", "descriptor_field", "truncate", "frames"]))
    if choice == "garbage":
        return draw(st.lists(st.binary(max_size=256), min_size=0, max_size=4))
    frames = valid_request(draw(st.integers(0, 2**63 - 1)))
    header = msgpack.unpackb(frames[0])
    if choice == "header_field":
        header[
            draw(
                st.sampled_from(
                    ["v", "kind", "id", "method", "deadline_s", "tensors", "meta", "end", "credit", "x"]
                )
            )
        ] = draw(json_like)
        return [msgpack.packb(header), *frames[1:]]
    if choice == "descriptor_field":
        descriptor = header["tensors"][draw(st.integers(0, 1))]
        key = draw(st.sampled_from(["name", "dtype", "shape", "chunk_bytes", "chunks", "codecs", "sizes"]))
        descriptor[key] = draw(
            json_like | st.lists(st.integers(-(2**62), 2**62), max_size=10) | st.just([1 << 40, 1 << 40])
        )
        return [msgpack.packb(header), *frames[1:]]
    if choice == "truncate":
        index = draw(st.integers(0, len(frames) - 1))
        cut = draw(st.integers(0, max(0, len(frames[index]) - 1)))
        return [*frames[:index], frames[index][:cut], *frames[index + 1 :]]
    data = draw(st.permutations(frames[1:]))  # frames reordered, dropped or duplicated
    drop = draw(st.integers(0, len(data)))
    return [frames[0], *data[:drop], *draw(st.lists(st.sampled_from(frames), max_size=2))]


@pytest.fixture(scope="module")
def fuzz_target():
    with spawn_python([RPC_NODE, "--max-message-bytes", str(MAX_MESSAGE_BYTES)]) as child:
        address = child.read_until("ADDRESS ")
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        call(address, "echo", "warm-up", {"v": np.zeros(1 << 16)})
        baseline = call(address, "stats").meta  # before any fuzzing
        try:
            yield address, dealer, baseline
        finally:
            dealer.close()


def call(address: str, method: str, meta=None, tensors=None):
    async def go():
        async with RpcClient() as client:
            return await client.call(address, method, meta, tensors, timeout_s=20)

    return asyncio.run(go())


def drain(dealer: zmq.Socket) -> int:
    count = 0
    while dealer.poll(0):
        dealer.recv_multipart()
        count += 1
    return count


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(hostile_messages(), min_size=1, max_size=5))
def test_hostile_messages_are_rejected_and_counted(fuzz_target, batch):
    _address, dealer, _baseline = fuzz_target
    for frames in batch:
        if frames:
            dealer.send_multipart(frames)
    drain(dealer)


@pytest.mark.slow
def test_server_survives_the_fuzzing_with_bounded_memory(fuzz_target):
    address, dealer, baseline = fuzz_target
    before = call(address, "stats").meta
    # A thousand more malformed requests, some declaring huge tensors, plus a few frames
    # over the node's size limit (zmq drops those connections before allocating).
    for i in range(1000):
        frames = valid_request(i)
        header = msgpack.unpackb(frames[0])
        header["tensors"][0]["shape"] = [1 << 30]
        dealer.send_multipart([msgpack.packb(header), *frames[1:]])
    oversized = zmq.Context.instance().socket(zmq.DEALER)
    oversized.setsockopt(zmq.LINGER, 0)
    oversized.connect(address)
    for _ in range(3):
        oversized.send_multipart([b"x" * (4 * MAX_MESSAGE_BYTES)])
    oversized.close()

    deadline = time.monotonic() + 30
    after = before
    while after["rejected"].get("limit", 0) - before["rejected"].get("limit", 0) < 1000:
        assert time.monotonic() < deadline, f"rejections not counted: {after['rejected']}"
        drain(dealer)
        after = call(address, "stats").meta
    # It still answers normal requests, tensors intact.
    reply = call(address, "echo", "hello", {"v": np.arange(10.0)})
    assert reply.meta == "hello" and reply.tensors["v"].tolist() == list(np.arange(10.0))
    # All the fuzzing together cost at most a few MiB of resident memory.
    growth = after["rss"] - baseline["rss"]
    assert growth < 64 << 20, f"server grew {growth / 2**20:.1f} MiB"
    assert sum(after["rejected"].values()) > 1000
