"""Flow-controlled streams: both sides of a call send items while the other consumes them.

A receiver grants its peer a window of items (``RpcConfig.stream_window``). The sender spends
one credit per item and waits when it has none; the receiver grants credits back as its
consumer takes items: on the items it sends the other way anyway, else in a credit message
once half a window is consumed. A receiver therefore never buffers more
than one window of items, however fast the sender or slow the consumer — a peer that sends
beyond its credit breaks the protocol and the stream is aborted with :class:`StreamError`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from agora_core import world
from agora_core.errors import DeadlineExceeded, StreamError
from agora_core.rpc.types import Payload, Request
from agora_core.wire.dtypes import Tensor
from agora_core.wire.message import Kind, Message

SendMessage = Callable[[Message], Awaitable[None]]


class StreamChannel:
    """Credits and the inbound queue of one end of a stream. Lives on the event loop."""

    def __init__(
        self,
        *,
        request_id: int,
        method: str,
        window: int,
        peer_window: int,
        deadline: float,
        send_message: SendMessage,
    ):
        self.request_id = request_id
        self.method = method
        self._credit_batch = max(1, window // 2)  # consumed items worth a credit message of their own
        self._deadline = deadline
        self._send_message = send_message
        self._credit = peer_window  # items we may send before the peer grants more
        self._granted = window  # items we allowed the peer so far, in total
        self._received = 0
        self._consumed_unacked = 0
        self._inbound: collections.deque[Message] = collections.deque()
        # Coroutines waiting for credit (senders) and for items (receivers); the end, an error
        # or the deadline wakes both. One timer per channel wakes them at the deadline --
        # cheaper than a timeout per wait, which the per-item path would otherwise pay twice.
        self._credit_waiters: list[asyncio.Future] = []
        self._item_waiters: list[asyncio.Future] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._peer_ended = False
        self._ended = False
        self._error: BaseException | None = None

    # --- driven by the socket owner -------------------------------------------------------

    def grant(self, credit: int) -> None:
        self._credit += credit
        _wake(self._credit_waiters)

    def feed(self, message: Message) -> None:
        """An item (or the end) from the peer, with any credit riding on it; raises
        StreamError when the peer broke the protocol."""
        if self._peer_ended:
            raise StreamError(f"stream {self.method!r}: item after the peer's end")
        if message.end:
            self._peer_ended = True
        else:
            self._received += 1
            if self._received > self._granted:
                raise StreamError(f"stream {self.method!r}: peer sent beyond its credit")
            self._inbound.append(message)
        _wake(self._item_waiters)
        if message.credit:  # granted after the item, so the item's reader runs (and owes
            self.grant(message.credit)  # credit) before the sender it unblocks

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._wake_all()

    def finish_inbound(self) -> None:
        """No more items will come (the final reply arrived)."""
        self._peer_ended = True
        self._wake_all()

    @property
    def buffered(self) -> int:
        return len(self._inbound)

    # --- used by the stream's owner coroutine ---------------------------------------------

    def close(self) -> None:
        """The call is over: drop the deadline timer (it would keep the channel alive)."""
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    def _wake_all(self) -> None:
        _wake(self._item_waiters)
        _wake(self._credit_waiters)

    def _expire(self) -> None:
        self._expired = True
        self._wake_all()

    async def _wait_changed(self, waiters: list[asyncio.Future], what: str) -> None:
        """Wait on ``waiters``' next change; the caller looks again at what it waits for."""
        if self._expired or world.monotonic() >= self._deadline:
            raise DeadlineExceeded(f"stream {self.method!r}: deadline passed while {what}")
        loop = asyncio.get_running_loop()
        if self._deadline_timer is None:
            self._deadline_timer = loop.call_at(self._deadline, self._expire)  # loop.time() is monotonic
        waiter = loop.create_future()
        waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            with contextlib.suppress(ValueError):
                waiters.remove(waiter)
            raise

    async def send(
        self, meta: Any = None, tensors: dict[str, Tensor] | None = None, *, compress: bool = True
    ) -> None:
        """Send one item, waiting for credit. Raw buffers are sent without copying: do not
        modify the arrays until the stream has ended. ``compress=False`` sends every chunk raw
        (the node's compression policy decides otherwise)."""
        if self._ended:
            raise StreamError(f"stream {self.method!r}: send after end")
        while self._credit <= 0:
            if self._error is not None:
                raise self._error
            await self._wait_changed(self._credit_waiters, "waiting for credit to send")
        if self._error is not None:
            raise self._error
        self._credit -= 1
        await self._send_message(
            Message(
                kind=Kind.STREAM,
                request_id=self.request_id,
                meta=meta,
                tensors=tensors or {},
                compress=compress,
                credit=self._piggyback(),
            )
        )

    async def end(self) -> None:
        """Tell the peer no more items follow (costs no credit). Idempotent."""
        if not self._ended and self._error is None:
            self._ended = True
            await self._send_message(
                Message(kind=Kind.STREAM, request_id=self.request_id, end=True, credit=self._piggyback())
            )

    def _piggyback(self) -> int:
        """Credit for the items consumed so far, to ride on a message going out anyway.

        Where items flow both ways (a reducer returns one difference per chunk), most credit
        travels this way and few credit messages are needed; a credit message still goes once
        half a window is consumed and nothing went out meanwhile, so credit is never later.
        """
        credit = self._consumed_unacked
        if not credit or self._peer_ended:
            return 0
        self._consumed_unacked = 0
        self._granted += credit
        return credit

    async def receive(self) -> Payload | None:
        """The next item from the peer, or None once it ended; raises the stream's error."""
        while not self._inbound:
            if self._error is not None:
                raise self._error
            if self._peer_ended:
                return None
            await self._wait_changed(self._item_waiters, "waiting for the next item")
        message = self._inbound.popleft()
        self._consumed_unacked += 1
        if self._consumed_unacked >= self._credit_batch and not self._peer_ended:
            # Items often arrive in bursts, each with credit for this side's sender: let a
            # sender woken by it go first and carry the credit on its item.
            await asyncio.sleep(0)
            if self._consumed_unacked >= self._credit_batch and not self._peer_ended and self._error is None:
                credit, self._consumed_unacked = self._consumed_unacked, 0
                self._granted += credit
                await self._send_message(Message(kind=Kind.CREDIT, request_id=self.request_id, credit=credit))
        return Payload(message.meta, message.tensors)

    def __aiter__(self):
        return self

    async def __anext__(self) -> Payload:
        item = await self.receive()
        if item is None:
            raise StopAsyncIteration
        return item


def _wake(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)
    waiters.clear()


class ServerStream(StreamChannel):
    """The server's end of a streaming call; ``request`` is the call's opening message.

    Iterate it for the client's items; ``send`` items back; the handler's return value is the
    final reply that ends the stream.
    """

    def __init__(self, request: Request, **kwargs):
        super().__init__(**kwargs)
        self.request = request


class ClientStream(StreamChannel):
    """The caller's end of a streaming call. Iterate it for the server's items; ``result()``
    waits for the handler's final reply."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._result: asyncio.Future = asyncio.get_running_loop().create_future()

    def resolve(self, message: Message | BaseException) -> None:
        """The final reply (or error) arrived: stop inbound items, settle ``result()``."""
        if self._result.done():
            return
        if isinstance(message, BaseException):
            self._result.set_exception(message)
            self._result.exception()  # retrieved: a caller that never awaits result() is fine
            self.fail(message)
        else:
            self._result.set_result(Payload(message.meta, message.tensors))
            self.finish_inbound()

    @property
    def done(self) -> bool:
        return self._result.done()

    async def result(self) -> Payload:
        remaining = self._deadline - world.monotonic()
        try:
            async with asyncio.timeout(max(remaining, 0)):
                return await asyncio.shield(self._result)
        except TimeoutError:
            raise DeadlineExceeded(f"stream {self.method!r}: no final reply by the deadline") from None
