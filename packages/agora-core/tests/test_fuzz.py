"""Fuzz a live server in its own process with random, truncated and oversized messages.

It must count each message it rejects once, under the reason the wire rules give, answer with
an error whoever it can identify, serve what is valid, and still answer normal requests; and
its memory must not have ballooned.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st

from agora_core.errors import LimitExceeded, UnsupportedProtocolVersion, WireError
from agora_core.rpc import RpcClient
from agora_core.wire.message import (
    Kind,
    Message,
    WireConfig,
    WireLimits,
    check_header,
    decode,
    decode_tensors,
    encode,
    peek_request_id,
    unpack_header,
)
from agora_devkit.processes import spawn_python, wait_until

MAX_MESSAGE_BYTES = 1 << 20  # the fuzzed node's limit: 1 MiB per message
LIMITS = WireLimits(max_message_bytes=MAX_MESSAGE_BYTES)  # all the node's limits
ANSWERED_AT_ONCE = {"echo", "stats"}  # rpc_node's methods that reply straight away
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


# Header values a sender could mean: another version, kind, method, a deadline already past,
# ids and credit at and beyond their bounds. Random values alone rarely reach these checks.
NEAR_VALID = {
    "v": st.lists(st.integers(0, 3), min_size=2, max_size=2),
    "kind": st.integers(0, 7),
    "id": st.integers(-1, 2**64 - 1),
    "method": st.sampled_from(["echo", "stats", "", "no.such.method", "m" * 200]),
    "deadline_s": st.floats(-10, 10),
    "end": st.booleans(),
    "credit": st.integers(-1, (1 << 20) + 1),
}


@st.composite
def hostile_messages(draw) -> list[bytes]:
    """Garbage, or a valid request with its header or frames damaged."""
    choice = draw(st.sampled_from(["garbage", "header_field", "descriptor_field", "truncate", "frames"]))
    if choice == "garbage":
        return draw(st.lists(st.binary(max_size=256), min_size=0, max_size=4))
    frames = valid_request(draw(st.integers(0, 2**63 - 1)))
    header = msgpack.unpackb(frames[0])
    if choice == "header_field":
        name = draw(
            st.sampled_from(
                ["v", "kind", "id", "method", "deadline_s", "tensors", "meta", "end", "credit", "x"]
            )
        )
        header[name] = draw(json_like | NEAR_VALID.get(name, st.nothing()))
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


class Peer:
    """A raw DEALER connection to the node: sends any frames, picks replies by request id."""

    def __init__(self, address: str):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self._ids = itertools.count(1)

    def close(self) -> None:
        self.sock.close()

    def reply(self, request_id: int, *, timeout_s: float = 10.0) -> Message:
        """The next reply to ``request_id`` (replies to anything else are passed over)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = (deadline - time.monotonic()) * 1000
            if remaining_ms <= 0 or not self.sock.poll(remaining_ms):
                raise TimeoutError(f"no reply to request {request_id} in {timeout_s:g} s")
            message = decode(self.sock.recv_multipart(), LIMITS)
            if message.request_id == request_id:
                return message

    def call(self, method: str, meta=None, tensors=None) -> Message:
        """A normal request; its successful reply."""
        rid = next(self._ids)
        request = Message(
            kind=Kind.REQUEST,
            method=method,
            request_id=rid,
            deadline_s=10.0,
            meta=meta,
            tensors=tensors or {},
        )
        self.sock.send_multipart(encode(request, WireConfig()))
        reply = self.reply(rid)
        assert reply.kind == Kind.RESPONSE, (method, reply.error_code, reply.error_message)
        return reply

    def rejected(self) -> dict[str, float]:
        """The node's rejection counters, by reason."""
        return self.call("stats").meta["rejected"]


def rejection_reason(error: WireError) -> str:
    """The reason a node counts a message under when the wire rules refuse it."""
    if isinstance(error, LimitExceeded):
        return "limit"
    if isinstance(error, UnsupportedProtocolVersion):
        return "version"
    return "malformed"


def expected_outcome(frames: list[bytes]) -> tuple[str | None, int | None]:
    """What the node must do with ``frames``, sent while nothing else is in flight: the reason
    it rejects them under (None: it serves them), and the request id of its reply (None: it
    has nobody to answer)."""
    try:
        header = unpack_header(frames[0], LIMITS)
    except WireError as exc:
        return rejection_reason(exc), None
    try:
        message = check_header(header, LIMITS)
    except WireError as exc:
        return rejection_reason(exc), peek_request_id(header)
    rid = message.request_id
    if message.kind != Kind.REQUEST:
        return "late", None  # a reply, stream item, credit or cancel for no running call
    if message.method not in ANSWERED_AT_ONCE:
        assume(message.method not in ("hang", "sink"))  # served, but not answered at once
        return "unknown_method", rid
    if message.deadline_s is not None and message.deadline_s <= 0:
        return "expired", rid
    try:
        decode_tensors(header, frames[1:], LIMITS)
    except WireError as exc:
        return rejection_reason(exc), rid
    return None, rid


@pytest.fixture
def peers(fuzz_target):
    """This test's own connections: one sends the hostile messages, one reads the counters."""
    hostile, control = Peer(fuzz_target[0]), Peer(fuzz_target[0])
    try:
        yield hostile, control
    finally:
        hostile.close()
        control.close()


def damaged(request_id: int = 7, **fields) -> list[bytes]:
    """A valid request with these header fields replaced."""
    frames = valid_request(request_id)
    header = {**msgpack.unpackb(frames[0]), **fields}
    return [msgpack.packb(header), *frames[1:]]


def declaring_a_huge_tensor() -> list[bytes]:
    frames = valid_request(8)
    header = msgpack.unpackb(frames[0])
    header["tensors"][0]["shape"] = [1 << 30]
    return [msgpack.packb(header), *frames[1:]]


# Every outcome, whatever hypothesis draws: served, then rejected for each reason, with the
# reason the server must count (spelled here, not derived from the wire code it tests).
OUTCOMES = [
    (damaged(), None, True),
    ([b"\xc1"], "malformed", False),  # not msgpack: no id to answer
    (damaged(id=-1), "malformed", False),  # no id to answer
    (damaged(end="yes"), "malformed", True),
    (damaged(v=[9, 0]), "version", True),
    (declaring_a_huge_tensor(), "limit", True),
    (damaged(kind=int(Kind.CANCEL)), "late", False),  # cancels no running call
    (damaged(method="no.such.method"), "unknown_method", True),
    (damaged(deadline_s=-1.0), "expired", True),
]
EVERY_OUTCOME = [frames for frames, _reason, _answered in OUTCOMES]


@pytest.mark.parametrize(("frames", "reason", "answered"), OUTCOMES)
def test_each_kind_of_hostile_message_is_counted_under_its_reason(peers, frames, reason, answered):
    hostile, control = peers
    before = control.rejected()
    hostile.sock.send_multipart(frames)
    if answered:
        reply = hostile.reply(msgpack.unpackb(frames[0])["id"])
        assert reply.kind == (Kind.ERROR if reason else Kind.RESPONSE)
    else:
        wait_until(lambda: control.rejected() != before, timeout_s=10, what=f"a {reason!r} rejection")
    assert control.rejected() == ({**before, reason: before.get(reason, 0) + 1} if reason else before)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(hostile_messages(), min_size=1, max_size=5))
@example(batch=EVERY_OUTCOME)
def test_hostile_messages_are_rejected_and_counted(peers, batch):
    hostile, control = peers
    for frames in batch:
        if not frames:
            continue  # zmq sends no message of zero frames
        reason, rid = expected_outcome(frames)
        event(f"{reason or 'served'}, {'answered' if rid is not None else 'not answered'}")
        before = control.rejected()
        hostile.sock.send_multipart(frames)  # one at a time: never two of ours in flight
        if rid is not None:  # answered: with an error when rejected, else by the handler
            reply = hostile.reply(rid)
            assert reply.kind in ((Kind.ERROR,) if reason else (Kind.RESPONSE, Kind.ERROR)), reason
        elif reason is not None:  # dropped without a word: wait until the node has counted it
            wait_until(
                lambda before=before: control.rejected() != before,
                timeout_s=10,
                what=f"a {reason!r} rejection",
            )
        expected = dict(before)
        if reason is not None:
            expected[reason] = expected.get(reason, 0) + 1
        assert control.rejected() == expected, (reason, frames[:1])
    reply = control.call("echo", "still serving", {"v": np.arange(10.0)})
    assert reply.meta == "still serving" and reply.tensors["v"].tolist() == list(np.arange(10.0))


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
    # Each declaration counted once, as over the limit; nothing else counted (zmq drops the
    # oversized frames before the node sees them).
    assert after["rejected"] == {**before["rejected"], "limit": before["rejected"].get("limit", 0) + 1000}
