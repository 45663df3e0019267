"""One ZeroMQ socket driven by the asyncio event loop, with the node's emulated link in front.

The socket is a plain (non-asyncio) zmq socket. Its file descriptor is registered with the
loop; when it signals, we drain every ready message without blocking. Sends are attempted
without blocking too; only a send that would block (a peer's high-water mark) waits, in an
outbox of its own destination, so one slow peer never holds up messages to the others. This
costs far less per message than one future per ``recv``/``send``, and everything runs on the
loop's thread: no socket is touched by two threads.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable, Sequence

import zmq

from agora_core import world
from agora_core.observability.logs import get_logger
from agora_core.rpc.linkemu import DelayLine, LinkEmulator
from agora_core.rpc.types import RpcConfig

log = get_logger("rpc.transport")

# Messages handled per wakeup before yielding to other tasks, so one busy socket cannot
# starve the loop.
_DRAIN_BUDGET = 128
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_NOBLOCK_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)
# Many nodes can share a process (tests, benchmarks): allow far more than zmq's 1023 sockets.
_MAX_SOCKETS = 16384

_context: zmq.Context | None = None
_context_lock = threading.Lock()


def context() -> zmq.Context:
    """The process-wide zmq context of Agora's sockets."""
    global _context
    with _context_lock:
        if _context is None or _context.closed:
            _context = zmq.Context()
            _context.set(zmq.MAX_SOCKETS, _MAX_SOCKETS)
        return _context


def frames_nbytes(frames: Sequence) -> int:
    total = 0
    for frame in frames:  # per message: skip building a memoryview where the size is at hand
        if isinstance(frame, (bytes, zmq.Frame)):
            total += len(frame)
        elif isinstance(frame, memoryview):
            total += frame.nbytes
        else:
            total += memoryview(frame).nbytes
    return total


def new_socket(kind: int, config: RpcConfig) -> zmq.Socket:
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # zmq disconnects a peer that sends a larger frame, before allocating it.
    sock.setsockopt(zmq.MAXMSGSIZE, config.wire.limits.max_frame_bytes + 1024)
    sock.setsockopt(zmq.SNDHWM, config.high_water_mark)
    sock.setsockopt(zmq.RCVHWM, config.high_water_mark)
    ivl_ms = max(1, int(config.reconnect_interval_s * 1000))
    sock.setsockopt(zmq.RECONNECT_IVL, ivl_ms)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 20 * ivl_ms)
    return sock


class SocketPump:
    """Owns one socket on the running loop: reads it, writes it, closes it.

    ``on_frames`` gets each received multipart message (a list of ``zmq.Frame``). Outgoing
    messages start with their destination's routing id (ROUTER sockets), which also keys the
    outbox they wait in when zmq cannot take them yet. With a link emulator, outgoing messages
    pass the node's upload pipe and incoming ones its download pipe first.
    """

    def __init__(
        self,
        sock: zmq.Socket,
        on_frames: Callable[[list], None],
        *,
        link: LinkEmulator | None = None,
        name: str = "socket",
    ):
        self._sock = sock
        self._on_frames = on_frames
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        # destination routing id -> messages waiting for room, in order
        self._outboxes: dict[bytes, collections.deque[tuple[list, asyncio.Future]]] = {}
        self._closed = False
        self._drain_scheduled = False
        self._up: DelayLine | None = None
        self._down: DelayLine | None = None
        # Fault injection (a dropped link): until this world.monotonic(), messages are neither
        # sent nor delivered. 0 is the one value the hot paths test, so it costs ~nothing.
        self._silent_until = 0.0
        if link is not None and not link.config.is_ideal:
            self._up = link.upload_line(self._send_now)
            self._down = link.download_line(self._dispatch)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.getsockopt(zmq.FD), self._on_events)
        for line in (self._up, self._down):
            if line is not None:
                line.start()
        self._schedule_drain()

    # --- a dropped link (fault injection) ------------------------------------------------------

    def drop_for(self, seconds: float) -> None:
        """Send and deliver nothing for ``seconds``: messages sent meanwhile vanish as on a cut
        link (their callers time out), messages received meanwhile are read and discarded."""
        self._silent_until = max(self._silent_until, world.monotonic() + seconds)

    def _silent(self) -> bool:
        if world.monotonic() < self._silent_until:
            return True
        self._silent_until = 0.0
        return False

    # --- sending ---------------------------------------------------------------------------

    async def send(self, frames: list, deadline: float | None = None) -> None:
        """Send one multipart message ``[routing id, *parts]``; buffers go without copying.

        Returns once zmq has the message (or, with an emulated link, once it is queued on the
        upload pipe); waits only while zmq cannot take it, at most until ``deadline``
        (``world.monotonic()``), then raises TimeoutError. Raises ConnectionError when the
        destination is unknown to the socket.
        """
        if self._closed:
            raise ConnectionError(f"{self._name} is closed")
        if self._silent_until and self._silent():
            return
        if self._up is not None:
            self._up.put(frames, frames_nbytes(frames))
            return
        await self._send_now(frames, deadline)

    def send_nowait(self, frames: list) -> bool:
        """Send at once if zmq takes the message now and nothing waits ahead of it for its
        destination; False otherwise (then :meth:`send` it). A reply made on the receive path
        goes out this way without a task of its own."""
        if self._silent_until and self._silent():
            return not self._closed  # "sent", into the cut link
        if self._closed or self._up is not None or bytes(frames[0]) in self._outboxes:
            return False
        return self._try_send(frames)

    async def _send_now(self, frames: list, deadline: float | None = None) -> None:
        key = bytes(frames[0])
        if key not in self._outboxes and self._try_send(frames):
            return
        future = self._loop.create_future()
        self._outboxes.setdefault(key, collections.deque()).append((frames, future))
        try:
            async with asyncio.timeout_at(deadline):
                await future
        except BaseException:
            self._discard(key, future)  # never send an abandoned message late
            raise

    def _discard(self, key: bytes, future: asyncio.Future) -> None:
        box = self._outboxes.get(key)
        if box is None:
            return
        kept = collections.deque(item for item in box if item[1] is not future)
        if kept:
            self._outboxes[key] = kept
        else:
            del self._outboxes[key]

    def _try_send(self, frames: list) -> bool:
        # Part by part with plain-int flags: pyzmq's send_multipart spends more time on flag
        # enums and checks than zmq spends sending a small message. A multipart message is
        # atomic in zmq: if its first part is accepted, so are the rest.
        sock = self._sock
        try:
            for frame in frames[:-1]:
                sock.send(frame, _NOBLOCK_MORE, copy=False)
            sock.send(frames[-1], _NOBLOCK, copy=False)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ConnectionError(f"{self._name}: no route to the destination") from None
            raise
        # A send can swallow the fd's edge for messages that arrived meanwhile: look again.
        # Reading EVENTS also re-arms the fd, so nothing is missed when none are waiting.
        if sock.getsockopt(_EVENTS) & _POLLIN:
            self._schedule_drain()
        return True

    def _flush_outboxes(self) -> None:
        for key in list(self._outboxes):
            box = self._outboxes[key]
            while box:
                frames, future = box[0]
                if future.done():  # the sender gave up
                    box.popleft()
                    continue
                try:
                    sent = self._try_send(frames)
                except ConnectionError as exc:
                    box.popleft()
                    future.set_exception(exc)
                    continue
                if not sent:
                    break
                box.popleft()
                future.set_result(None)
            if not box:
                del self._outboxes[key]

    # --- receiving -------------------------------------------------------------------------

    def _schedule_drain(self) -> None:
        if not self._drain_scheduled and not self._closed:
            self._drain_scheduled = True
            self._loop.call_soon(self._on_events)

    def _on_events(self) -> None:
        self._drain_scheduled = False
        if self._closed:
            return
        sock = self._sock
        dropping = bool(self._silent_until) and self._silent()
        for _ in range(_DRAIN_BUDGET):
            # Asking EVENTS is much cheaper than a recv that raises zmq.Again.
            if not sock.getsockopt(_EVENTS) & _POLLIN:
                break
            frame = sock.recv(_NOBLOCK, copy=False)
            frames = [frame]
            while frame.more:
                frame = sock.recv(_NOBLOCK, copy=False)
                frames.append(frame)
            if dropping:
                continue
            if self._down is not None:
                self._down.put(frames, frames_nbytes(frames))
            else:
                self._dispatch(frames)
            if self._closed:
                return
        else:
            self._schedule_drain()  # budget spent with more waiting: continue next turn
        if self._outboxes:
            self._flush_outboxes()

    def _dispatch(self, frames: list) -> None:
        # A dispatcher bug must not kill the socket's only reader: log it and keep serving.
        try:
            self._on_frames(frames)
        except Exception:
            log.exception("dispatch_failed", socket=self._name)

    # --- lifecycle -------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for line in (self._up, self._down):
            if line is not None:
                await line.stop()
        if self._loop is not None:
            self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
        for box in self._outboxes.values():
            for _frames, future in box:
                if not future.done():
                    future.set_exception(ConnectionError(f"{self._name} closed before sending"))
        self._outboxes.clear()
        self._sock.close(linger=0)
