"""The RPC client: calls and streams to remote :class:`RpcServer` nodes, over one socket.

A node talks to many peers (a full-membership DHT talks to all of them), so the client
connects one ROUTER socket to every peer it calls, naming each connection with a routing id
of its own, instead of opening a socket (and a monitor) per peer. A connection is made on
first use and reused; the socket's monitor says when it is up or lost, so a call to a dead or
vanished peer fails with :class:`PeerUnreachable` instead of waiting out its whole deadline.
Idle connections beyond ``max_connections`` are closed, least recently used first.

Every call gets a request id and a deadline that travels with it; a reply is matched to its
call by that id on the connection it went out on. A call that runs out of time, or whose
caller gives up, sends the server a cancel.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

from agora_core import world
from agora_core.auth.security import HELLO_METHOD, TransportSecurity
from agora_core.errors import (
    DeadlineExceeded,
    PeerRefused,
    PeerUnreachable,
    RpcError,
    WireError,
    rpc_error_from_code,
)
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.deadlines import DeadlineBuckets
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.rpc.network import LOST, REFUSED, REJECTED, UP, ClientEndpoint
from agora_core.rpc.peer_connection import PeerConnection
from agora_core.rpc.streams import ClientStream
from agora_core.rpc.transport import frames_nbytes
from agora_core.rpc.types import Payload, RpcConfig, Traffic
from agora_core.wire.addresses import normalize_address
from agora_core.wire.dtypes import Tensor
from agora_core.wire.message import Kind, Message, check_header, decode_tensors, encode, unpack_header

log = get_logger("rpc.client")

_GREETING_IDS = 1 << 62  # request ids of greetings: apart from the calls' (which count from 1)


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
        deadline_s=deadline - world.monotonic(),
        meta=meta,
        tensors=tensors or {},
        credit=credit,
    )


def _settle(future: asyncio.Future | None, stream: ClientStream | None, outcome) -> None:
    if future is not None and not future.done():
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    if stream is not None:
        stream.resolve(outcome)


class RpcClient:
    """Calls methods on remote :class:`RpcServer` nodes. Use from one event loop. Only the
    connection methods below touch the socket; the calls register on their peer's
    ``pending``/``streams`` and send through ``_send``."""

    def __init__(
        self,
        *,
        config: RpcConfig | None = None,
        link: LinkEmulator | None = None,
        metrics: NodeMetrics | None = None,
        node_id: str = "",
        security: TransportSecurity | None = None,
    ):
        metrics = metrics or NodeMetrics(role="node", instance=node_id)
        self._outcomes: dict[tuple[str], int] = {}  # plain counts: a Counter.inc() per call costs more
        metrics.counter_from(
            "agora_rpc_client_calls_total",
            "Calls made, by outcome.",
            ["outcome"],
            lambda: dict(self._outcomes),
        )
        self.config = config or RpcConfig()
        self.link = link
        self.node_id = node_id
        self.security = security
        self._greeting_ids = itertools.count(_GREETING_IDS)
        self._watching: asyncio.Task | None = None
        self._peers: collections.OrderedDict[str, PeerConnection] = collections.OrderedDict()  # LRU order
        self._by_routing_id: dict[bytes, PeerConnection] = {}
        self._routing_ids = itertools.count(1)
        self._pump: ClientEndpoint | None = None
        self._background: set[asyncio.Task] = set()
        self.traffic = Traffic()
        self._m_connections = metrics.gauge("agora_rpc_client_connections", "Open peer connections.")
        self._lost_listeners: list[Callable[[str], None]] = []
        metrics.counter_from(
            "agora_rpc_client_bytes_total",
            "Bytes through the client socket.",
            ["direction"],
            self.traffic.bytes_by_direction,
        )
        self._request_ids = itertools.count(1)
        self._deadlines = DeadlineBuckets(_expire)

    def on_connection_lost(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(address)`` whenever an established connection drops (the peer
        closed it or died); failure detectors use it as a hint to look at that peer now."""
        self._lost_listeners.append(listener)

    # --- the socket and its connections -----------------------------------------------------

    def _socket(self) -> ClientEndpoint:
        if self._pump is None:
            self._pump = world.network().open_client(
                config=self.config,
                link=self.link,
                on_frames=self._on_frames,
                on_event=self._on_link_event,
                security=self.security,
            )
            if self.security is not None:
                self.security.on_credential_changed(self._greet_all)
                self.security.on_revocations(lambda _revocations: self._recheck())
                self._watching = asyncio.get_running_loop().create_task(
                    self._watch(), name="rpc-client credentials"
                )
        return self._pump

    def fail_calls_to(self, address: str, why: str) -> None:
        """Fail the unary calls waiting on ``address`` now (its node was declared dead); streams
        keep their deadlines, the connection stays (a node wrongly declared dead refutes)."""
        peer = self._peers.get(normalize_address(address))
        for rid, future in list(peer.pending.items()) if peer is not None else ():
            if rid < _GREETING_IDS and not future.done():  # a greeting settles the connection
                future.set_exception(PeerUnreachable(why))

    def drop_link(self, seconds: float) -> None:
        """Fault injection: nothing in or out of this client for ``seconds`` (a dropped link)."""
        self._socket().drop_for(seconds)

    def _peer(self, address: str) -> PeerConnection:
        address = normalize_address(address)
        peer = self._peers.get(address)
        if peer is not None:
            self._peers.move_to_end(address)
            return peer
        endpoint = self._socket()
        if len(self._peers) >= self.config.max_connections:
            # the least recently used idle connection (the first found: the map is in LRU order)
            idle = next((p for p in self._peers.values() if not p.busy), None)
            if idle is not None:
                self._drop(idle, None)
        peer = PeerConnection(address, b"p%d" % next(self._routing_ids))
        if self.security is not None:
            peer.public_key, peer.credentialed = self.security.server_key(address)
        endpoint.connect(address, peer.routing_id, peer.public_key)
        self._peers[address] = peer
        self._by_routing_id[peer.routing_id] = peer
        self._m_connections.set(len(self._peers))
        return peer

    def _drop(self, peer: PeerConnection, error: Exception | None) -> None:
        """Forget a connection: fail its calls, close it so zmq stops reconnecting."""
        if peer.error is not None:
            return  # dropped already: keep the first reason
        if self._peers.get(peer.address) is peer:
            del self._peers[peer.address]
        self._by_routing_id.pop(peer.routing_id, None)
        peer.fail_all(error or PeerUnreachable(f"connection to {peer.address} was closed"))
        if self._pump is not None:
            self._pump.disconnect(peer.address)
        self._m_connections.set(len(self._peers))

    def _on_link_event(self, kind: str, address: str, detail: str) -> None:
        peer = self._peers.get(address)
        if peer is None:
            return
        if kind == UP:
            if self.security is None:
                peer.connected = True
                peer.settled.set()
            elif not peer.greeting:
                self._spawn(self._greet(peer))
        elif kind == REJECTED and not peer.connected:
            self._drop(peer, PeerRefused(f"refused connection to {peer.address}: {detail}"))
        elif kind == LOST:
            self._drop(peer, PeerUnreachable(f"connection to {peer.address} was lost"))
            for listener in self._lost_listeners:
                listener(peer.address)
        elif kind == REFUSED and not peer.connected:
            # Fail the calls now rather than at the connect timeout; the next call tries afresh.
            self._drop(peer, PeerUnreachable(f"could not connect to {peer.address} (refused)"))

    # --- greetings (authorized runs): credentials both ways on every connection ------------------

    async def _greet(self, peer: PeerConnection) -> None:
        """Present our credential and check the server's; the connection is usable once both
        hold (PeerRefused and dropped otherwise). Run again when a credential is renewed."""
        peer.greeting = True
        rid = next(self._greeting_ids)
        future = asyncio.get_running_loop().create_future()
        peer.pending[rid] = future
        deadline = world.monotonic() + self.config.connect_timeout_s
        request = Message(
            kind=Kind.REQUEST,
            method=HELLO_METHOD,
            request_id=rid,
            deadline_s=self.config.connect_timeout_s,
            meta=self.security.hello(),
        )
        try:
            await self._send(peer, request, deadline)
            async with asyncio.timeout(max(0.0, deadline - world.monotonic())):  # send and answer
                reply = await future
            peer.identity = self.security.check_server(reply.meta, peer.public_key, peer.credentialed)
        except TimeoutError:
            self._drop(peer, PeerRefused(f"{peer.address} did not answer the greeting in time"))
            return
        except PeerRefused as exc:
            self._drop(peer, PeerRefused(f"{peer.address}: {exc}"))
            return
        except RpcError as exc:
            self._drop(peer, PeerRefused(f"{peer.address} refused this node: {exc}"))
            return
        finally:
            peer.pending.pop(rid, None)
            if future.done() and not future.cancelled():
                future.exception()  # failed by a drop while our send failed too: seen here
            peer.greeting = False
        peer.connected = True
        peer.settled.set()

    def _greet_all(self) -> None:
        """Our credential was renewed: present it on every open connection."""
        for peer in list(self._peers.values()):
            if peer.connected and not peer.greeting:
                self._spawn(self._greet(peer))

    def _recheck(self) -> None:
        """Drop connections to peers whose credential expired or was revoked; ask peers whose
        credential is due for renewal for their new one."""
        now = world.wall()
        verifier = self.security.verifier
        for peer in list(self._peers.values()):
            identity = peer.identity
            if identity is None or not peer.connected:
                continue
            if not identity.valid(now) or verifier.revoked(identity):
                why = "was revoked" if verifier.revoked(identity) else "expired"
                self._drop(peer, PeerRefused(f"the credential of {peer.address} {why}"))
            elif now >= identity.renew_at and not peer.greeting:
                self._spawn(self._greet(peer))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.security.recheck_s)
            self._recheck()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def connect(self, address: str) -> None:
        """Open the connection to ``address`` now (PeerUnreachable if nobody accepts it within
        the connect timeout), so that a call timed next measures the round trip alone."""
        await self._wait_connected(self._peer(address), world.monotonic() + self.config.connect_timeout_s)

    async def _wait_connected(self, peer: PeerConnection, deadline: float) -> None:
        if not peer.settled.is_set():
            give_up_at = peer.opened + self.config.connect_timeout_s
            try:
                async with asyncio.timeout_at(min(give_up_at, deadline)):
                    await peer.settled.wait()
            except TimeoutError:
                if world.monotonic() < give_up_at:
                    # Only this call ran out of time. The connection goes on being set up for
                    # the next one: dropping it here would start every short call (a probe)
                    # on a loaded node from scratch, and none would ever get through.
                    raise PeerUnreachable(f"no connection to {peer.address} yet (still connecting)") from None
                error = PeerUnreachable(
                    f"no connection to {peer.address} within {self.config.connect_timeout_s:.2f} s "
                    "(is a node listening there?)"
                )
                self._drop(peer, error)
                raise error from None
        if peer.error is not None:
            raise peer.error

    def _frames(self, peer: PeerConnection, message: Message) -> list:
        """``message`` encoded for ``peer``: its routing id first."""
        message.sender = self.node_id
        frames = encode(message, self.config.wire)
        self.traffic.sent(frames_nbytes(frames))
        frames.insert(0, peer.routing_id)
        return frames

    def _put_nowait(self, peer: PeerConnection, frames: list) -> bool:
        """Send at once if zmq takes it (the common case: no coroutine); False: :meth:`_put` it."""
        try:
            return self._socket().send_nowait(frames)
        except ConnectionError:
            raise PeerUnreachable(f"connection to {peer.address} is gone") from None

    async def _put(self, peer: PeerConnection, frames: list, deadline: float | None = None) -> None:
        try:
            await self._socket().send(frames, deadline)
        except ConnectionError:
            raise PeerUnreachable(f"connection to {peer.address} is gone") from None

    async def _send(self, peer: PeerConnection, message: Message, deadline: float | None = None) -> None:
        frames = self._frames(peer, message)
        if not self._put_nowait(peer, frames):
            await self._put(peer, frames, deadline)

    def _send_soon(self, peer: PeerConnection, message: Message) -> None:
        """Fire-and-forget (cancel notices); failures only matter to a peer that is gone."""
        if peer.routing_id not in self._by_routing_id:
            return
        task = asyncio.get_running_loop().create_task(self._send(peer, message))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieve, ignore
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- incoming messages -------------------------------------------------------------------

    def _on_frames(self, frames: list) -> None:
        nbytes = frames_nbytes(frames)
        self.traffic.received(nbytes)
        peer = self._by_routing_id.get(frames[0].bytes)
        if peer is None or len(frames) < 2:
            return  # from a connection already dropped
        limits = self.config.wire.limits
        try:
            header = unpack_header(frames[1], limits)
            message = check_header(header, limits)
        except WireError as exc:
            log.warning("bad_reply_dropped", peer=peer.address, error=str(exc))
            return
        rid = message.request_id
        future = peer.pending.get(rid)
        stream = peer.streams.get(rid)
        if future is None and stream is None:
            return  # a reply to a call that already gave up
        if message.kind in (Kind.RESPONSE, Kind.STREAM):
            try:
                message.tensors = decode_tensors(header, frames[2:], limits)
            except WireError as exc:
                _settle(future, stream, exc)
                return
        if message.kind == Kind.ERROR:
            _settle(future, stream, rpc_error_from_code(message.error_code, message.error_message))
        elif message.kind == Kind.RESPONSE:
            _settle(future, stream, message)
        elif stream is not None and message.kind == Kind.CREDIT:
            stream.grant(message.credit)
        elif stream is not None and message.kind == Kind.STREAM:
            try:
                stream.feed(message)
            except Exception as exc:
                _settle(None, stream, exc)
                self._send_soon(peer, Message(kind=Kind.CANCEL, request_id=rid))

    # --- lifecycle ---------------------------------------------------------------------------

    async def disconnect(self, address: str) -> None:
        """Close the connection to ``address`` (pending calls fail with PeerUnreachable)."""
        peer = self._peers.get(normalize_address(address))
        if peer is not None:
            self._drop(peer, None)

    async def close(self) -> None:
        for peer in list(self._peers.values()):
            self._drop(peer, None)
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._pump is not None:
            await self._pump.close()
        self._pump = None

    @property
    def connections(self) -> int:
        return len(self._peers)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # --- calls -------------------------------------------------------------------------------

    def _count(self, outcome: str) -> None:
        key = (outcome,)
        self._outcomes[key] = self._outcomes.get(key, 0) + 1

    def _deadline(self, timeout_s: float | None) -> float:
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        return world.monotonic() + timeout

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
        peer = self._peer(address)
        rid = next(self._request_ids)
        future = asyncio.get_running_loop().create_future()
        peer.pending[rid] = future
        outcome = "ok"
        sent = False
        self._deadlines.add(deadline, peer.pending, rid)  # on expiry it fails the future
        try:
            if peer.error is not None or not peer.connected:  # else: no coroutine to await
                await self._wait_connected(peer, deadline)
            frames = self._frames(peer, _request(rid, method, deadline, meta, tensors))
            if not self._put_nowait(peer, frames):
                await self._put(peer, frames, deadline)
            sent = True
            reply: Message = await future
            return Payload(reply.meta, reply.tensors)
        except (_Expired, TimeoutError):
            outcome = DeadlineExceeded.code
            raise DeadlineExceeded(
                f"{method!r} on {peer.address}: no reply within "
                f"{timeout_s or self.config.default_timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Exception as exc:
            outcome = getattr(exc, "code", type(exc).__name__)
            raise
        finally:
            if future.done() and not future.cancelled():
                future.exception()  # failed while we waited elsewhere (connecting): seen here
            peer.pending.pop(rid, None)
            if sent and outcome in ("cancelled", DeadlineExceeded.code):
                self._send_soon(peer, Message(kind=Kind.CANCEL, request_id=rid))
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
        window: int | None = None,
    ) -> AsyncIterator[ClientStream]:
        """Open a streaming call; the opening message carries ``meta``/``tensors``.

        Inside the block: ``await stream.send(...)``, ``await stream.end()``, iterate the
        server's items, ``await stream.result()`` for the final reply. Leaving the block
        before the final reply cancels the call on the server. ``window``: the items the
        server may have in flight to this caller (default ``RpcConfig.stream_window``).
        """
        window = self.config.window(window)
        deadline = self._deadline(timeout_s)
        peer = self._peer(address)
        rid = next(self._request_ids)
        stream = ClientStream(
            request_id=rid,
            method=method,
            window=window,
            peer_window=0,  # the server grants credit once it accepted the call
            deadline=deadline,
            send_message=lambda message: self._send(peer, message, deadline),
        )
        peer.streams[rid] = stream
        outcome = "ok"
        try:
            await self._wait_connected(peer, deadline)
            await self._send(peer, _request(rid, method, deadline, meta, tensors, credit=window))
            yield stream
        except BaseException as exc:
            outcome = getattr(
                exc, "code", "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
            )
            raise
        finally:
            peer.streams.pop(rid, None)
            stream.close()
            if not stream.done:
                self._send_soon(peer, Message(kind=Kind.CANCEL, request_id=rid))
            self._count(outcome)
