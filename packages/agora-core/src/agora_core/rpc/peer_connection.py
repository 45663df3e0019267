"""One client connection: its routing id on the client socket, who is at the other end,
and the calls and streams waiting on it."""

from __future__ import annotations

import asyncio

from agora_core import world
from agora_core.auth.peer_identity import PeerIdentity
from agora_core.rpc.streams import ClientStream


class PeerConnection:
    """One connection: its routing id on the client socket and the calls waiting on it."""

    def __init__(self, address: str, routing_id: bytes):
        self.address = address
        self.routing_id = routing_id
        self.opened = world.monotonic()
        self.public_key: bytes | None = None  # the key the node there must hold (secured)
        self.credentialed = True  # ... and whether it must hold a credential too
        self.identity: PeerIdentity | None = None  # who it proved to be (secured)
        self.greeting = False  # a greeting is on its way
        self.connected = False
        self.error: Exception | None = None  # why the connection was dropped
        self.settled = asyncio.Event()  # connected, or dropped: either ends a wait to connect
        self.pending: dict[int, asyncio.Future] = {}
        self.streams: dict[int, ClientStream] = {}

    @property
    def busy(self) -> bool:
        return bool(self.pending or self.streams)

    def fail_all(self, error: Exception) -> None:
        self.error = error
        self.settled.set()
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
        for stream in self.streams.values():
            stream.resolve(error)
