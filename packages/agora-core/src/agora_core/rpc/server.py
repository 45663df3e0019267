"""The RPC server: one ROUTER socket, handlers registered by method name.

A coroutine handler runs in a task of its own under the caller's deadline. A plain function
(a handler that never waits: a ping, a DHT lookup) runs on the receive path and its reply
goes out at once — no task, no timer, one turn of the loop per small call. Whatever arrives — garbage,
truncated frames, oversized declarations, unknown methods, floods beyond the in-flight limit —
is answered with a typed error when the sender can be identified, otherwise dropped, and in
both cases counted in ``agora_rpc_rejected_messages_total{reason}``. The server keeps serving.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Union

from agora_core import world
from agora_core.auth.access import CREDENTIALED, Access
from agora_core.auth.security import TransportSecurity
from agora_core.errors import (
    BadRequest,
    DeadlineExceeded,
    HandlerFailed,
    RpcError,
    StreamError,
    WireError,
)
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.rpc.network import ServerEndpoint
from agora_core.rpc.server_calls import (
    Call,
    Handler,
    error_message,
    handler_failure,
    refusal_before_start,
    reject_reason,
    response_message,
)
from agora_core.rpc.server_metrics import ServerMetrics
from agora_core.rpc.server_replies import ServerReplies
from agora_core.rpc.server_security import ServerSecurity
from agora_core.rpc.streams import ServerStream
from agora_core.rpc.transport import frames_nbytes
from agora_core.rpc.types import Payload, Request, RpcConfig, Traffic
from agora_core.wire.addresses import normalize_address
from agora_core.wire.message import (
    Kind,
    Message,
    check_header,
    decode_tensors,
    peek_request_id,
    unpack_header,
)

UnaryHandler = Callable[[Request], Union[Awaitable[Union[Payload, None]], Payload, None]]
StreamHandler = Callable[[ServerStream], Awaitable[Union[Payload, None]]]

log = get_logger("rpc.server")


class RpcServer:
    """Serve registered methods on ``listen`` (``host:port``; port 0 picks a free one).

    With a ``security`` (an authorized run) the socket is a CURVE server, every caller greets
    it with its credential first (``auth.hello``), each request is checked against its
    method's ``access``, and ``Request.sender`` is the caller's authenticated node id.
    """

    def __init__(
        self,
        *,
        listen: str = "127.0.0.1:0",
        config: RpcConfig | None = None,
        link: LinkEmulator | None = None,
        metrics: NodeMetrics | None = None,
        node_id: str = "",
        security: TransportSecurity | None = None,
    ):
        self.config = config or RpcConfig()
        self.node_id = node_id
        self.security = security
        self._guard = ServerSecurity(security) if security is not None else None
        self._listen = normalize_address(listen)
        self._link = link
        self._handlers: dict[str, Handler] = {}
        self._calls: dict[tuple[bytes, int], Call] = {}
        self._pump: ServerEndpoint | None = None
        self._closing = False
        self.address: str | None = None
        metrics = metrics or NodeMetrics(role="node", instance=node_id)
        self.traffic = Traffic()  # messages and bytes, as plain numbers for tools and benchmarks
        self._metrics = ServerMetrics(metrics, self.traffic)
        self._replies = ServerReplies(node_id=node_id, wire=self.config.wire, traffic=self.traffic)

    # --- registration and lifecycle --------------------------------------------------------

    def register(
        self,
        method: str,
        handler: Callable,
        *,
        stream: bool = False,
        window: int | None = None,
        access: Access = CREDENTIALED,
    ) -> None:
        """Serve ``method``: ``await handler(Request)``, or with ``stream=True``
        ``await handler(ServerStream)``; either returns a :class:`Payload` or None. A plain
        function ``handler(Request)`` is called at once when the request arrives and must not
        block: it is for answers at hand.

        ``window``: the items a streaming caller may have in flight to this handler (default
        ``RpcConfig.stream_window``). ``access``: who may call it in an authorized run (any
        credentialed peer unless told otherwise)."""
        if not isinstance(method, str) or not 0 < len(method) <= self.config.wire.limits.max_name_chars:
            raise ValueError("method name must be a non-empty, bounded str")
        if method in self._handlers:
            raise ValueError(f"method {method!r} is already registered")
        if window is not None and not stream:
            raise ValueError("a stream window is for streaming methods only")
        inline = not stream and not inspect.iscoroutinefunction(handler)
        self._handlers[method] = Handler(handler, stream, self.config.window(window), access, inline)

    @property
    def methods(self) -> list[str]:
        return sorted(self._handlers)

    async def start(self) -> str:
        """Bind and start serving; returns the bound ``tcp://host:port`` address."""
        try:
            self._pump = world.network().open_server(
                listen=self._listen,
                config=self.config,
                link=self._link,
                on_frames=self._on_frames,
                guard=self._guard,
            )
        except OSError:
            if self._guard is not None:
                self._guard.close()
            raise
        self.address = self._pump.address
        self._replies.pump = self._pump
        log.debug("server_started", address=self.address, methods=self.methods)
        return self.address

    async def stop(self, *, grace_s: float = 0.0) -> None:
        """Stop serving. In-flight calls get ``grace_s`` to finish, then are cancelled."""
        self._closing = True
        tasks = [c.task for c in self._calls.values() if c.task is not None]
        if tasks and grace_s > 0:
            await asyncio.wait(tasks, timeout=grace_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._replies.background, return_exceptions=True)
        if self._pump is not None:
            await self._pump.close()
            self._pump = self._replies.pump = None
        if self._guard is not None:
            self._guard.close()

    def drop_link(self, seconds: float) -> None:
        """Fault injection: nothing in or out of this server for ``seconds`` (a dropped link)."""
        if self._pump is not None:
            self._pump.drop_for(seconds)

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    @property
    def inflight(self) -> int:
        return len(self._calls)

    # --- incoming messages (runs on the socket's receive task) -----------------------------

    def _busy(self) -> str | None:
        inflight = len(self._calls)
        return f"{inflight} requests in flight" if inflight >= self.config.max_inflight_requests else None

    def _reject(self, reason: str) -> None:
        self._metrics.rejected(reason)

    def _on_frames(self, frames: list) -> None:
        nbytes = frames_nbytes(frames)
        self.traffic.received(nbytes)
        if len(frames) < 2:
            self._reject("malformed")
            return
        identity, data = frames[0].bytes, frames[2:]
        limits = self.config.wire.limits
        try:
            header = unpack_header(frames[1], limits)
        except WireError as exc:
            self._reject(reject_reason(exc))
            return
        try:
            message = check_header(header, limits)
        except WireError as exc:
            self._reject(reject_reason(exc))
            rid = peek_request_id(header)
            if rid is not None:
                self._replies.error(identity, rid, BadRequest(str(exc)))
            return
        key = (identity, message.request_id)
        if message.kind == Kind.REQUEST:
            self._accept(identity, key, message, header, data, frames[0])
            return
        call = self._calls.get(key)
        if call is None:
            self._reject("late")  # the call already ended: a late item, credit or cancel
            return
        if message.kind == Kind.CANCEL:
            if call.task is not None:
                call.cancelled_by_peer = True
                call.task.cancel()
        elif message.kind == Kind.CREDIT and call.stream is not None:
            call.stream.grant(message.credit)
        elif message.kind == Kind.STREAM and call.stream is not None:
            try:
                message.tensors = decode_tensors(header, data, limits)
                call.stream.feed(message)
            except (WireError, StreamError) as exc:
                self._reject("stream_violation")
                self._abort(key, call, exc if isinstance(exc, RpcError) else BadRequest(str(exc)))
        else:
            self._reject("unexpected_kind")

    def _accept(self, identity: bytes, key, message: Message, header: dict, data: list, first) -> None:
        rid = message.request_id
        handler = self._handlers.get(message.method)
        caller, sender = None, message.sender
        if self._guard is not None:
            caller, answer = self._guard.screen(first, message, handler, self._handlers.values())
            if isinstance(answer, RpcError):
                self._reject(answer.code)
                return self._replies.error(identity, rid, answer)
            if answer is not None:  # the greeting's: sent at once, not from a task (see screen)
                return self._replies.reply(identity, answer)
            sender = caller.node_id if caller is not None else ""
        remaining = message.deadline_s if message.deadline_s is not None else self.config.default_timeout_s
        refused = refusal_before_start(
            message,
            handler,
            duplicate=key in self._calls,
            served=self._handlers,
            busy="shutting down" if self._closing else self._busy(),
            remaining_s=remaining,
        )
        if refused is not None:
            self._reject(refused[0])
            return self._replies.error(identity, rid, refused[1])
        try:
            tensors = decode_tensors(header, data, self.config.wire.limits)
        except WireError as exc:
            self._reject(reject_reason(exc))
            return self._replies.error(identity, rid, BadRequest(str(exc)))
        request = Request(
            method=message.method,
            meta=message.meta,
            tensors=tensors,
            sender=sender,
            peer=identity,
            deadline=world.monotonic() + remaining,
            caller=caller,
        )
        if handler.inline:
            return self._answer_inline(identity, rid, handler, request)
        self._start(identity, rid, handler, request, message.credit)

    def _start(
        self, identity: bytes, rid: int, handler: Handler, request: Request, credit: int, running=None
    ) -> None:
        """Run ``handler`` (or finish ``running``, the awaitable it already returned) in a task."""
        key = (identity, rid)
        call = Call(method=request.method, started=time.perf_counter())
        if handler.streaming:
            call.stream = ServerStream(
                request,
                request_id=rid,
                method=request.method,
                window=handler.window,
                peer_window=credit,
                deadline=request.deadline,
                send_message=lambda m: self._replies.send(identity, m),
            )
        self._calls[key] = call
        self._metrics.inflight.inc()
        loop = asyncio.get_running_loop()
        call.task = loop.create_task(self._run(key, identity, handler, request, call, running))
        call.timer = loop.call_at(request.deadline, call.deadline_reached)
        # A done callback, not a finally: it also runs for a task cancelled before it started.
        call.task.add_done_callback(lambda _task: self._forget(key))

    def _forget(self, key) -> None:
        call = self._calls.pop(key, None)
        if call is None:
            return
        call.timer.cancel()
        if call.stream is not None:
            call.stream.close()
        self._metrics.inflight.dec()
        self._metrics.handled(call.method, call.outcome, time.perf_counter() - call.started)

    # --- running a call ---------------------------------------------------------------------

    def _answer_inline(self, identity: bytes, rid: int, handler: Handler, request: Request) -> None:
        started = time.perf_counter()
        try:
            result = handler.fn(request)
            if inspect.isawaitable(result):  # a callable that returns a coroutine: a task runs it
                return self._start(identity, rid, handler, request, 0, result)
            reply, outcome = response_message(rid, result), "ok"
        except Exception as exc:
            error = handler_failure(request.method, exc)
            reply, outcome = error_message(rid, error), error.code
        self._replies.reply(identity, reply)
        self._metrics.handled(request.method, outcome, time.perf_counter() - started)

    async def _run(
        self, key, identity: bytes, handler: Handler, request: Request, call: Call, running=None
    ) -> None:
        rid = key[1]
        outcome = "ok"
        try:
            try:
                if call.stream is not None:  # open the client's send window
                    await self._replies.send(
                        identity, Message(kind=Kind.CREDIT, request_id=rid, credit=handler.window)
                    )
                if running is None:
                    running = handler.fn(call.stream if call.stream is not None else request)
                result = await running
            except asyncio.CancelledError:
                if not call.deadline_passed or call.cancelled_by_peer:
                    raise
                raise DeadlineExceeded(f"{request.method!r} ran past the caller's deadline") from None
            try:
                await self._replies.send(identity, response_message(rid, result))
            except WireError as exc:
                raise HandlerFailed(f"reply could not be encoded: {exc}") from None
        except asyncio.CancelledError:
            if not call.cancelled_by_peer:
                raise
            outcome = "cancelled"
        except Exception as exc:  # a typed refusal, or a handler bug: report it, keep serving
            error = handler_failure(request.method, exc)
            outcome = error.code
            await self._replies.send(identity, error_message(rid, error))
        finally:
            call.outcome = outcome

    def _abort(self, key, call: Call, error: RpcError) -> None:
        if call.stream is not None:
            call.stream.fail(error)
        call.cancelled_by_peer = True  # no reply from the task: the error below is the reply
        call.outcome = error.code
        if call.task is not None:
            call.task.cancel()
        self._forget(key)
        self._replies.error(key[0], key[1], error)
