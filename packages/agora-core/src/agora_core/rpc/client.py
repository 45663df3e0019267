"""The RPC client: calls and streams to remote :class:`RpcServer` nodes.

Every call gets a request id and a deadline that travels with it; a reply is matched to its
call by that id on the connection it went out on (see :mod:`agora_core.rpc.connections`: one
ROUTER socket for all peers). A call that runs out of time, or whose caller gives up, sends
the server a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

from agora_core import world
from agora_core.auth.security import TransportSecurity
from agora_core.errors import DeadlineExceeded
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.connections import ClientConnections
from agora_core.rpc.deadlines import DeadlineBuckets
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.rpc.streams import ClientStream
from agora_core.rpc.types import Payload, RpcConfig
from agora_core.wire.dtypes import Tensor
from agora_core.wire.message import Kind, Message


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


class RpcClient(ClientConnections):
    """Calls methods on remote :class:`RpcServer` nodes. Use from one event loop."""

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
        super().__init__(
            config=config or RpcConfig(), link=link, metrics=metrics, node_id=node_id, security=security
        )
        self._request_ids = itertools.count(1)
        self._deadlines = DeadlineBuckets(_expire)

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
