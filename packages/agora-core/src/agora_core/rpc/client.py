"""The RPC client: one DEALER connection per peer, many calls in flight on each.

Replies are matched to calls by request id. A connection is made on first use and reused; a
socket monitor tells when it is up or lost, so a call to a dead or vanished peer fails with
:class:`PeerUnreachable` instead of waiting out its whole deadline.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from agora_core.dtypes import Tensor
from agora_core.errors import DeadlineExceeded, PeerUnreachable, WireError, rpc_error_from_code
from agora_core.linkemu import LinkEmulator
from agora_core.logs import get_logger
from agora_core.metrics import NodeMetrics
from agora_core.rpc.streams import ClientStream
from agora_core.rpc.transport import SocketPump, frames_nbytes, new_socket, normalize_address
from agora_core.rpc.types import Payload, RpcConfig
from agora_core.wire import Kind, Message, check_header, decode_tensors, encode, unpack_header

log = get_logger("rpc.client")


class _Connection:
    """One DEALER socket to one peer, its receive task and its monitor task."""

    def __init__(self, client: RpcClient, address: str):
        self.address = address
        self._client = client
        self._sock = new_socket(zmq.DEALER, client.config)
        # Queue messages only on a completed connection, never for a peer that is not there.
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._monitor = SocketPump(monitor, self._on_monitor_event, name=f"rpc-monitor {address}")
        self._sock.connect(address)
        self._pump = SocketPump(self._sock, self._on_frames, link=client.link, name=f"rpc-client {address}")
        self._ids = itertools.count(1)
        self.pending: dict[int, asyncio.Future] = {}
        self.streams: dict[int, ClientStream] = {}
        self.connected = asyncio.Event()
        self._ever_connected = False
        self._monitor.start()
        self._pump.start()

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.streams)

    def next_id(self) -> int:
        return next(self._ids)

    def _on_monitor_event(self, frames: list) -> None:
        event = parse_monitor_message([f.bytes for f in frames])["event"]
        if event == zmq.EVENT_CONNECTED:
            self._ever_connected = True
            self.connected.set()
        elif event == zmq.EVENT_DISCONNECTED:
            self.connected.clear()
            self.fail_all(PeerUnreachable(f"connection to {self.address} was lost"))

    def fail_all(self, error: Exception) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        for stream in self.streams.values():
            stream.resolve(error)

    async def wait_connected(self, deadline: float) -> None:
        if self.connected.is_set():
            return
        limit = min(self._client.config.connect_timeout_s, deadline - time.monotonic())
        try:
            await asyncio.wait_for(self.connected.wait(), max(limit, 0))
        except TimeoutError:
            raise PeerUnreachable(
                f"no connection to {self.address} within {max(limit, 0):.2f} s"
                + ("" if self._ever_connected else " (is a node listening there?)")
            ) from None

    async def send(self, message: Message, deadline: float | None = None) -> None:
        message.sender = self._client.node_id
        frames = encode(message, self._client.config.wire)
        self._client.bytes_sent += frames_nbytes(frames)
        await self._pump.send(frames, deadline)

    def send_soon(self, message: Message) -> None:
        """Fire-and-forget (cancel notices); failures only matter to a peer that is gone."""
        task = asyncio.get_running_loop().create_task(self.send(message))
        self._client.track(task)

    def _on_frames(self, frames: list) -> None:
        self._client.bytes_received += frames_nbytes(frames)
        limits = self._client.config.wire.limits
        try:
            header = unpack_header(frames[0], limits)
            message = check_header(header, limits)
        except WireError as exc:
            log.warning("bad_reply_dropped", peer=self.address, error=str(exc))
            return
        rid = message.request_id
        future = self.pending.get(rid)
        stream = self.streams.get(rid)
        if future is None and stream is None:
            return  # a reply to a call that already gave up
        if message.kind in (Kind.RESPONSE, Kind.STREAM):
            try:
                message.tensors = decode_tensors(header, frames[1:], limits)
            except WireError as exc:
                self._settle(rid, future, stream, exc)
                return
        if message.kind == Kind.ERROR:
            self._settle(rid, future, stream, rpc_error_from_code(message.error_code, message.error_message))
        elif message.kind == Kind.RESPONSE:
            self._settle(rid, future, stream, message)
        elif stream is not None and message.kind == Kind.CREDIT:
            stream.grant(message.credit)
        elif stream is not None and message.kind == Kind.STREAM:
            try:
                stream.feed(message)
            except Exception as exc:
                self._settle(rid, None, stream, exc)
                self.send_soon(Message(kind=Kind.CANCEL, request_id=rid))

    @staticmethod
    def _settle(rid: int, future, stream, outcome) -> None:
        if future is not None and not future.done():
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)
        if stream is not None:
            stream.resolve(outcome)

    async def close(self) -> None:
        self.fail_all(PeerUnreachable(f"connection to {self.address} was closed"))
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        await self._monitor.close()
        await self._pump.close()


class _Expired(Exception):
    """A call's own deadline timer fired (kept apart from any TimeoutError a peer reports)."""


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(_Expired())


def _request(rid: int, method: str, deadline: float, meta, tensors, *, credit: int = 0) -> Message:
    """The message that opens a call; its deadline travels as the seconds left now."""
    return Message(
        kind=Kind.REQUEST,
        method=method,
        request_id=rid,
        deadline_s=deadline - time.monotonic(),
        meta=meta,
        tensors=tensors or {},
        credit=credit,
    )


class RpcClient:
    """Calls methods on remote :class:`RpcServer` nodes. Use from one event loop."""

    def __init__(
        self,
        *,
        config: RpcConfig | None = None,
        link: LinkEmulator | None = None,
        metrics: NodeMetrics | None = None,
        node_id: str = "",
    ):
        self.config = config or RpcConfig()
        self.link = link
        self.node_id = node_id
        self._connections: collections.OrderedDict[str, _Connection] = collections.OrderedDict()
        self._background: set[asyncio.Task] = set()
        self.bytes_sent = 0
        self.bytes_received = 0
        metrics = metrics or NodeMetrics(role="node", instance=node_id)
        self._m_calls = metrics.counter(
            "agora_rpc_client_calls_total", "Calls made, by outcome.", ["outcome"]
        )
        self._m_outcomes: dict[str, Any] = {}  # bound children: labels() is slow per call

    def _count(self, outcome: str) -> None:
        child = self._m_outcomes.get(outcome)
        if child is None:
            child = self._m_outcomes[outcome] = self._m_calls.labels(outcome=outcome)
        child.inc()

    def track(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _connection(self, address: str) -> _Connection:
        address = normalize_address(address)
        conn = self._connections.get(address)
        if conn is not None:
            self._connections.move_to_end(address)
            return conn
        if len(self._connections) >= self.config.max_connections:
            for old_address, old in list(self._connections.items()):
                if not old.busy:  # evict the least recently used idle connection
                    del self._connections[old_address]
                    self.track(asyncio.get_running_loop().create_task(old.close()))
                    break
        conn = _Connection(self, address)
        self._connections[address] = conn
        return conn

    async def disconnect(self, address: str) -> None:
        """Drop the connection to ``address`` (pending calls fail with PeerUnreachable)."""
        conn = self._connections.pop(normalize_address(address), None)
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        conns = list(self._connections.values())
        self._connections.clear()
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _deadline(self, timeout_s: float | None) -> float:
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        return time.monotonic() + timeout

    async def call(
        self,
        address: str,
        method: str,
        meta: Any = None,
        tensors: dict[str, Tensor] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> Payload:
        """Call ``method`` on the node at ``address`` and return its reply.

        Raises the remote's typed error (``UnknownMethod``, ``BadRequest``, ``HandlerFailed``,
        ``Overloaded``), ``DeadlineExceeded`` after ``timeout_s``, or ``PeerUnreachable``.
        Cancelling the awaiting task cancels the handler on the server too.
        """
        deadline = self._deadline(timeout_s)
        conn = self._connection(address)
        rid = conn.next_id()
        future = asyncio.get_running_loop().create_future()
        conn.pending[rid] = future
        outcome = "ok"
        sent = False
        # One timer per call: on expiry it fails the future (cheaper than asyncio.timeout).
        timer = asyncio.get_running_loop().call_at(deadline, _expire, future)
        try:
            await conn.wait_connected(deadline)
            await conn.send(_request(rid, method, deadline, meta, tensors), deadline)
            sent = True
            reply: Message = await future
            return Payload(reply.meta, reply.tensors)
        except (_Expired, TimeoutError):
            outcome = DeadlineExceeded.code
            raise DeadlineExceeded(
                f"{method!r} on {conn.address}: no reply within {timeout_s or self.config.default_timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = getattr(exc, "code", type(exc).__name__)
            raise
        finally:
            timer.cancel()
            conn.pending.pop(rid, None)
            if sent and outcome in ("cancelled", DeadlineExceeded.code):
                conn.send_soon(Message(kind=Kind.CANCEL, request_id=rid))
            self._count(outcome)

    @contextlib.asynccontextmanager
    async def open_stream(
        self,
        address: str,
        method: str,
        meta: Any = None,
        tensors: dict[str, Tensor] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[ClientStream]:
        """Open a streaming call; the opening message carries ``meta``/``tensors``.

        Inside the block: ``await stream.send(...)``, ``await stream.end()``, iterate the
        server's items, ``await stream.result()`` for the final reply. Leaving the block
        before the final reply cancels the call on the server.
        """
        deadline = self._deadline(timeout_s)
        conn = self._connection(address)
        rid = conn.next_id()
        stream = ClientStream(
            request_id=rid,
            method=method,
            window=self.config.stream_window,
            peer_window=0,  # the server grants credit once it accepted the call
            deadline=deadline,
            send_message=conn.send,
        )
        conn.streams[rid] = stream
        outcome = "ok"
        try:
            await conn.wait_connected(deadline)
            await conn.send(_request(rid, method, deadline, meta, tensors, credit=self.config.stream_window))
            yield stream
        except BaseException as exc:
            outcome = getattr(
                exc, "code", "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
            )
            raise
        finally:
            conn.streams.pop(rid, None)
            if not stream.done:
                conn.send_soon(Message(kind=Kind.CANCEL, request_id=rid))
            self._count(outcome)
