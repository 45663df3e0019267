"""The network under the RPC layer: where a server binds and a client's connections go.

:class:`RpcServer` and the client's connections never touch a socket themselves; they open an
endpoint on the world's network (:func:`agora_core.world.network`): ZeroMQ over TCP here, or
the simulator's in-memory network (:mod:`agora_sim.network`). An endpoint sends and
receives multipart messages whose first frame is the routing id of a connection; a client
endpoint also dials addresses and reports what becomes of each connection through
``on_event(kind, address, detail)``, ``kind`` one of :data:`UP`, :data:`LOST`, :data:`REFUSED`,
:data:`REJECTED`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from agora_core.auth.curve import curve_public_key
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.rpc.transport import SocketPump, new_socket
from agora_core.rpc.types import RpcConfig

if TYPE_CHECKING:
    from agora_core.auth.security import TransportSecurity
    from agora_core.rpc.server_security import ServerSecurity

UP = "up"  # the connection is established (and its secure handshake done)
LOST = "lost"  # an established connection dropped: the peer closed it or died
REFUSED = "refused"  # nobody accepted the connection
REJECTED = "rejected"  # the secure handshake failed; detail says why

OnFrames = Callable[[list], None]
OnEvent = Callable[[str, str, str], None]


class Endpoint(Protocol):
    """One socket's sending half (its receiving half calls ``on_frames``)."""

    async def send(self, frames: list, deadline: float | None = None) -> None: ...

    def send_nowait(self, frames: list) -> bool: ...

    def drop_for(self, seconds: float) -> None: ...

    async def close(self) -> None: ...


class ServerEndpoint(Endpoint, Protocol):
    address: str


class ClientEndpoint(Endpoint, Protocol):
    def connect(self, address: str, routing_id: bytes, server_key: bytes | None) -> None: ...

    def disconnect(self, address: str) -> None: ...


class Network(Protocol):
    def open_server(
        self,
        *,
        listen: str,
        config: RpcConfig,
        link: LinkEmulator | None,
        on_frames: OnFrames,
        guard: ServerSecurity | None,
    ) -> ServerEndpoint:
        """Bind ``listen`` and start receiving (OSError when it cannot be bound)."""
        ...

    def open_client(
        self,
        *,
        config: RpcConfig,
        link: LinkEmulator | None,
        on_frames: OnFrames,
        on_event: OnEvent,
        security: TransportSecurity | None,
    ) -> ClientEndpoint:
        """A socket that dials peers and starts receiving their replies."""
        ...


# --- ZeroMQ ------------------------------------------------------------------------------------

_UP = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_CONNECT_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)  # a connect attempt failed (refused, ...)
# a CURVE handshake failed: the node there does not hold the key we expect (no detail, or a
# protocol error), or its ZAP handler refused our key (auth)
WRONG_KEY = "the node there does not hold the key expected of it"
BROKEN_HANDSHAKE = "the secure handshake broke (is the node there in an open run?)"
KEY_REFUSED = "the node there refused this node's key"
_HANDSHAKE_FAILED = {
    int(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL): WRONG_KEY,
    int(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL): BROKEN_HANDSHAKE,
    int(zmq.EVENT_HANDSHAKE_FAILED_AUTH): KEY_REFUSED,
}
_EVENT_MASK = _UP | _DISCONNECTED | _CONNECT_RETRIED
for _event in _HANDSHAKE_FAILED:
    _EVENT_MASK |= _event


class ZmqServerEndpoint(SocketPump):
    """A bound ROUTER socket on the running loop."""

    address: str


class ZmqClientEndpoint(SocketPump):
    """A ROUTER socket connected to every peer the client calls, each connection named by a
    routing id of its own; the socket's monitor says when each is up or lost."""

    def __init__(self, sock: zmq.Socket, on_frames: OnFrames, on_event: OnEvent, link: LinkEmulator | None):
        super().__init__(sock, on_frames, link=link, name="rpc-client")
        self._on_event = on_event
        self._monitor = SocketPump(
            sock.get_monitor_socket(_EVENT_MASK), self._on_monitor, name="rpc-client monitor"
        )

    def start(self) -> None:
        self._monitor.start()
        super().start()

    def connect(self, address: str, routing_id: bytes, server_key: bytes | None) -> None:
        if server_key is not None:
            self.socket.curve_serverkey = curve_public_key(server_key)  # read by the connect below
        self.socket.setsockopt(zmq.CONNECT_ROUTING_ID, routing_id)
        self.socket.connect(address)

    def disconnect(self, address: str) -> None:
        with contextlib.suppress(zmq.ZMQError):  # so zmq stops reconnecting
            self.socket.disconnect(address)

    def _on_monitor(self, frames: list) -> None:
        event = parse_monitor_message([f.bytes for f in frames])
        address, kind = event["endpoint"].decode(), event["event"]
        if kind == _UP:
            self._on_event(UP, address, "")
        elif kind in _HANDSHAKE_FAILED:
            self._on_event(REJECTED, address, _HANDSHAKE_FAILED[kind])
        elif kind == _DISCONNECTED:
            self._on_event(LOST, address, "")
        elif kind == _CONNECT_RETRIED:
            # Nobody accepted the connection (on a LAN or loopback: refused).
            self._on_event(REFUSED, address, "")

    async def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.socket.disable_monitor()
        await super().close()
        await self._monitor.close()


class ZmqNetwork:
    """The real network: ZeroMQ over TCP."""

    def open_server(
        self,
        *,
        listen: str,
        config: RpcConfig,
        link: LinkEmulator | None,
        on_frames: OnFrames,
        guard: ServerSecurity | None,
    ) -> ZmqServerEndpoint:
        sock = new_socket(zmq.ROUTER, config)
        if guard is not None:
            guard.secure(sock)
        try:
            sock.bind(listen)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise OSError(f"cannot listen on {listen}: {exc}") from None
        address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        endpoint = ZmqServerEndpoint(sock, on_frames, link=link, name=f"rpc-server {address}")
        endpoint.address = address
        endpoint.start()
        return endpoint

    def open_client(
        self,
        *,
        config: RpcConfig,
        link: LinkEmulator | None,
        on_frames: OnFrames,
        on_event: OnEvent,
        security: TransportSecurity | None,
    ) -> ZmqClientEndpoint:
        sock = new_socket(zmq.ROUTER, config)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable sends raise instead of vanishing
        if security is not None:
            sock.curve_secretkey = security.curve_secret
            sock.curve_publickey = security.curve_public
        endpoint = ZmqClientEndpoint(sock, on_frames, on_event, link)
        endpoint.start()
        return endpoint
