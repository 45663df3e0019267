"""How the RPC server's answers leave its socket: encoded, counted, sent without a task when
zmq takes them at once."""

from __future__ import annotations

import asyncio
import contextlib

from agora_core.errors import HandlerFailed, RpcError, WireError
from agora_core.rpc.server_calls import error_message
from agora_core.rpc.transport import SocketPump, frames_nbytes
from agora_core.rpc.types import Traffic
from agora_core.wire.message import Message, WireConfig, encode


class ServerReplies:
    """The sending half of one server. ``pump`` is its socket while it serves (None before
    start and after stop: then nothing is sent, and a caller waiting times out)."""

    def __init__(self, *, node_id: str, wire: WireConfig, traffic: Traffic):
        self.node_id = node_id
        self.pump: SocketPump | None = None
        self.background: set[asyncio.Task] = set()  # sends that had to wait for room
        self._wire = wire
        self._traffic = traffic

    async def send(self, identity: bytes, message: Message) -> None:
        """Send from a call's task; waits while zmq cannot take it. Raises WireError when the
        message cannot be encoded (the caller turns that into its own error reply)."""
        message.sender = self.node_id
        frames = encode(message, self._wire)
        if self.pump is not None:
            self._traffic.sent(frames_nbytes(frames))
            await self.pump.send([identity, *frames])

    def error(self, identity: bytes, rid: int, error: RpcError) -> None:
        self.reply(identity, error_message(rid, error))

    def reply(self, identity: bytes, message: Message) -> None:
        """Send ``message`` from the receive path: at once when zmq takes it, else in a task."""
        if self.pump is None:
            return
        message.sender = self.node_id
        try:
            frames = encode(message, self._wire)
        except WireError as exc:
            error = HandlerFailed(f"reply could not be encoded: {exc}")
            frames = encode(error_message(message.request_id, error), self._wire)
        self._traffic.sent(frames_nbytes(frames))
        frames.insert(0, identity)
        if not self.pump.send_nowait(frames):
            task = asyncio.get_running_loop().create_task(self._send_later(self.pump, frames))
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    @staticmethod
    async def _send_later(pump: SocketPump, frames: list) -> None:
        with contextlib.suppress(ConnectionError):  # closed meanwhile: the caller times out
            await pump.send(frames)
