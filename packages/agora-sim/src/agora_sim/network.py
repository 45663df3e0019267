"""The simulated network: the RPC layer's endpoints (:mod:`agora_core.rpc.network`) in memory.

Semantics follow ZeroMQ over TCP as Agora uses it: a client connection is made on first use
and is up after one round trip (or refused, when the host there runs but nothing listens);
messages sent before it is up wait for it; a connection delivers in order and loses nothing;
when a server closes or its host dies, its clients hear that the connection was lost one
one-way latency later. A host fallen silent or cut off by a partition sends and receives
nothing and nobody hears of it: calls to it time out, as across a real internet. Every message
pays its hosts' link delays (:mod:`agora_sim.links`) and is folded into the trace. An
authorized run's connections add CURVE's handshake and its refusals (:mod:`agora_sim.curve`).
"""

from __future__ import annotations

import asyncio
import collections
import random

from agora_core.auth.curve import curve_public_key
from agora_core.rpc.network import LOST, REFUSED, REJECTED, UP, OnEvent, OnFrames
from agora_core.rpc.transport import frames_nbytes
from agora_core.rpc.types import RpcConfig
from agora_sim.curve import SECURE_HANDSHAKE_ROUND_TRIPS, caller_frame, handshake
from agora_sim.frames import SimFrame
from agora_sim.hosts import SimHost, current_host
from agora_sim.links import LinkModel, StreamWindow, crossing_s, one_way_s, path_window
from agora_sim.trace import Trace


class _Connection:
    __slots__ = (
        "address",
        "client",
        "identity",
        "in_flight",
        "last_arrival",
        "routing_id",
        "server",
        "server_key",
        "up",
        "user_id",
        "waiting",
        "windows",
    )

    def __init__(self, client: SimClientEndpoint, routing_id: bytes, address: str):
        self.client = client
        self.routing_id = routing_id
        self.address = address
        self.server: SimServerEndpoint | None = None
        self.identity = b""  # the server's name for this connection
        self.up = False
        self.waiting: list[list] = []  # messages sent before the connection was up
        # per direction (0: to the server, 1: to the client): the last arrival time, which the
        # next may not precede, and the messages on their way, oldest first. Each arrival timer
        # takes the oldest: timers due at one instant may fire in any order, messages may not.
        self.last_arrival = [0.0, 0.0]
        self.in_flight: tuple[collections.deque, collections.deque] = (
            collections.deque(),
            collections.deque(),
        )
        self.windows: tuple[StreamWindow, StreamWindow] | None = None  # per direction (a TCP window)
        self.server_key: bytes | None = None  # the X25519 key the client expects there (secured)
        self.user_id: str | None = None  # the client's key as the server admitted it (secured)


class SimEndpoint:
    def __init__(self, network: SimNetwork, host: SimHost, on_frames: OnFrames):
        self.network = network
        self.host = host
        self._on_frames = on_frames
        self.closed = False
        self._silent_until = 0.0
        host.endpoints[self] = None

    def drop_for(self, seconds: float) -> None:
        self._silent_until = max(self._silent_until, self.network.now() + seconds)

    def silent(self) -> bool:
        return self.network.now() < self._silent_until

    async def send(self, frames: list, deadline: float | None = None) -> None:
        if not self.host.alive:
            return  # a dead process's last gasps (its tasks' cleanup): nobody can see them
        if self.closed:
            raise ConnectionError("the endpoint is closed")
        self.send_nowait(frames)

    def deliver(self, frames: list) -> None:
        if not self.closed and not self.silent():
            self._on_frames(frames)

    def close_now(self) -> None:
        self.closed = True
        self.host.endpoints.pop(self, None)

    async def close(self) -> None:
        self.close_now()


class SimServerEndpoint(SimEndpoint):
    def __init__(self, network: SimNetwork, host: SimHost, on_frames: OnFrames, address: str, guard):
        super().__init__(network, host, on_frames)
        self.address = address
        self.guard = guard  # ServerSecurity of an authorized run's server; None: open
        self.connections: dict[bytes, _Connection] = {}
        self._identities = 0

    def accept(self, connection: _Connection) -> None:
        self._identities += 1
        connection.identity = b"c%d" % self._identities
        connection.server = self
        self.connections[connection.identity] = connection

    def send_nowait(self, frames: list) -> bool:
        connection = self.connections.get(bytes(frames[0]))
        if connection is not None and not self.closed and not self.silent():  # else: dropped, as ROUTER does
            self.network.transmit(connection, frames[1:], to_server=False)
        return True

    def close_now(self) -> None:
        if self.closed:
            return
        super().close_now()
        self.network.unbind(self)
        for connection in list(self.connections.values()):
            self.network.notify_lost(connection)
        self.connections.clear()


class SimClientEndpoint(SimEndpoint):
    def __init__(
        self,
        network: SimNetwork,
        host: SimHost,
        on_frames: OnFrames,
        on_event: OnEvent,
        config: RpcConfig,
        security=None,
    ):
        super().__init__(network, host, on_frames)
        self.on_event = on_event
        self.config = config
        self.security = security  # TransportSecurity of an authorized run's client; None: open
        self.by_routing_id: dict[bytes, _Connection] = {}
        self.by_address: dict[str, _Connection] = {}

    def connect(self, address: str, routing_id: bytes, server_key: bytes | None) -> None:
        connection = _Connection(self, routing_id, address)
        connection.server_key = None if server_key is None else curve_public_key(server_key)
        self.by_routing_id[routing_id] = connection
        self.by_address[address] = connection
        self.network.dial(connection)

    def disconnect(self, address: str) -> None:
        connection = self.by_address.pop(address, None)
        if connection is not None:
            self._forget(connection)

    def _forget(self, connection: _Connection) -> None:
        self.by_routing_id.pop(connection.routing_id, None)
        if self.by_address.get(connection.address) is connection:
            del self.by_address[connection.address]
        if connection.server is not None:
            connection.server.connections.pop(connection.identity, None)
        connection.up = False

    def send_nowait(self, frames: list) -> bool:
        if not self.host.alive:
            return True
        connection = self.by_routing_id.get(bytes(frames[0]))
        if connection is None:
            raise ConnectionError("no route to the destination")  # as ROUTER_MANDATORY
        if self.closed or self.silent():
            return True  # into the cut link
        if not connection.up:
            connection.waiting.append(frames[1:])
        else:
            self.network.transmit(connection, frames[1:], to_server=True)
        return True

    def close_now(self) -> None:
        if self.closed:
            return
        super().close_now()
        for connection in list(self.by_routing_id.values()):
            self._forget(connection)


class SimNetwork:
    """Hosts, the servers bound on them, and every message between them."""

    def __init__(self, loop: asyncio.AbstractEventLoop, rng: random.Random, trace: Trace | None = None):
        self.loop = loop
        self.rng = rng
        self.trace = trace or Trace()
        self.hosts: list[SimHost] = []
        self._servers: dict[str, SimServerEndpoint] = {}
        self._hosts_by_ip: dict[str, SimHost] = {}
        self._default_host: SimHost | None = None

    def now(self) -> float:
        return self.loop.time()

    def add_host(self, name: str, link: LinkModel | None = None) -> SimHost:
        host = SimHost(len(self.hosts), name, link or LinkModel())
        self.hosts.append(host)
        self._hosts_by_ip[host.ip] = host
        return host

    def _host(self) -> SimHost:
        host = current_host()
        if host is None:  # code run outside any host: one shared host with an ideal link
            if self._default_host is None:
                self._default_host = self.add_host("default")
            host = self._default_host
        if not host.alive:
            raise ConnectionError(f"host {host.name} was killed")
        return host

    # --- the rpc.network.Network interface ----------------------------------------------------

    def open_server(
        self, *, listen: str, config: RpcConfig, link, on_frames: OnFrames, guard
    ) -> SimServerEndpoint:
        host = self._host()
        ip, _, port = listen.removeprefix("tcp://").rpartition(":")
        if ip not in ("127.0.0.1", "0.0.0.0", "localhost", "*", host.ip):
            raise OSError(f"cannot listen on {listen}: host {host.name} is {host.ip}")
        address = f"tcp://{host.ip}:{host.port() if port in ('0', '*') else int(port)}"
        if address in self._servers:
            raise OSError(f"cannot listen on {listen}: {address} is in use")
        server = SimServerEndpoint(self, host, on_frames, address, guard)
        self._servers[address] = server
        return server

    def open_client(
        self, *, config: RpcConfig, link, on_frames: OnFrames, on_event: OnEvent, security
    ) -> SimClientEndpoint:
        return SimClientEndpoint(self, self._host(), on_frames, on_event, config, security)

    def unbind(self, server: SimServerEndpoint) -> None:
        if self._servers.get(server.address) is server:
            del self._servers[server.address]

    # --- reachability -------------------------------------------------------------------------

    def reachable(self, src: SimHost, dst: SimHost) -> bool:
        now = self.now()
        if not (src.alive and dst.alive) or src.silent(now) or dst.silent(now):
            return False
        return src.group is None or dst.group is None or src.group == dst.group

    def partition(self, groups: list[list[SimHost]]) -> None:
        """Cut the hosts into ``groups`` that cannot reach each other (hosts in none reach all)."""
        for number, group in enumerate(groups):
            for host in group:
                host.group = number
        self.trace.record(self.now(), Trace.FAULT, len(groups), 0, b"partition")

    def heal(self) -> None:
        for host in self.hosts:
            host.group = None
        self.trace.record(self.now(), Trace.FAULT, 0, 0, b"heal")

    def kill(self, host: SimHost) -> None:
        """The host's process dies: its tasks are cancelled, its connections close (peers hear
        of it), and it never comes back (a restarted node is a new host)."""
        host.alive = False
        self.trace.record(self.now(), Trace.FAULT, host.index, 0, b"kill")
        for endpoint in list(host.endpoints):
            endpoint.close_now()
        for task in list(host.tasks):
            task.cancel()

    def silence(self, host: SimHost, seconds: float) -> None:
        host.silent_until = max(host.silent_until, self.now() + seconds)
        self.trace.record(self.now(), Trace.FAULT, host.index, 0, b"silence")

    # --- connections --------------------------------------------------------------------------

    def dial(self, connection: _Connection) -> None:
        src = connection.client.host
        ip = connection.address.removeprefix("tcp://").rpartition(":")[0]
        dst = self._hosts_by_ip.get(ip)
        if dst is None or not self.reachable(src, dst):  # no answer: zmq retries; the caller times out
            delay = connection.client.config.reconnect_interval_s
            self.loop.call_at(self.now() + delay, self._redial, connection)
            return
        round_trip_s = 2 * one_way_s(src.link.model, dst.link.model)
        if connection.server_key is not None:  # CURVE's HELLO/WELCOME and INITIATE/READY too
            round_trip_s *= 1 + SECURE_HANDSHAKE_ROUND_TRIPS
        self.loop.call_at(self.now() + round_trip_s, self._answer, connection, dst)

    def _redial(self, connection: _Connection) -> None:
        client = connection.client
        if not client.closed and client.by_routing_id.get(connection.routing_id) is connection:
            self.dial(connection)

    def _answer(self, connection: _Connection, dst: SimHost) -> None:
        client = connection.client
        if client.closed or client.by_routing_id.get(connection.routing_id) is not connection:
            return  # given up meanwhile
        server = self._servers.get(connection.address)
        if server is None or server.closed:
            self.trace.record(self.now(), Trace.REFUSED, client.host.index, dst.index)
            client.on_event(REFUSED, connection.address, "")
            return
        rejected = handshake(connection, server)
        if rejected:
            self.trace.record(self.now(), Trace.REJECTED, client.host.index, dst.index)
            client.on_event(REJECTED, connection.address, rejected)
            return
        server.accept(connection)
        connection.up = True
        window = path_window(client.host.link.model, dst.link.model)
        if window is not None:
            round_trip_s = 2 * one_way_s(client.host.link.model, dst.link.model)
            connection.windows = (StreamWindow(window, round_trip_s), StreamWindow(window, round_trip_s))
        self.trace.record(self.now(), Trace.CONNECTED, client.host.index, dst.index)
        client.on_event(UP, connection.address, "")
        waiting, connection.waiting = connection.waiting, []
        for frames in waiting:
            self.transmit(connection, frames, to_server=True)

    def notify_lost(self, connection: _Connection) -> None:
        """The server end closed: the client hears of it one one-way latency later."""
        client = connection.client
        delay = one_way_s(connection.server.host.link.model, client.host.link.model)
        self.loop.call_at(self.now() + delay, self._lost, connection)

    def _lost(self, connection: _Connection) -> None:
        client = connection.client
        if client.closed or client.by_routing_id.get(connection.routing_id) is not connection:
            return
        client._forget(connection)
        self.trace.record(self.now(), Trace.LOST, client.host.index, connection.server.host.index)
        client.on_event(LOST, connection.address, "")

    # --- messages -----------------------------------------------------------------------------

    def transmit(self, connection: _Connection, parts: list, *, to_server: bool) -> None:
        client, server = connection.client, connection.server
        src, dst = (client.host, server.host) if to_server else (server.host, client.host)
        now = self.now()
        if not self.reachable(src, dst):
            self.trace.drop(now, src.index, dst.index)
            return
        frames = [SimFrame(part) for part in parts]  # a copy: the sender may reuse its buffers
        nbytes = frames_nbytes(frames)
        self.trace.message(now, src.index, dst.index, frames[0] if frames else b"", nbytes)
        departed = src.link.departure(now, nbytes)
        direction = 0 if to_server else 1
        if connection.windows is not None:  # the stream's own pace: a window per round trip
            departed = max(departed, connection.windows[direction].release(now, nbytes))
        arrived = max(
            departed + crossing_s(src.link.model, dst.link.model, self.rng),
            connection.last_arrival[direction],
        )
        connection.last_arrival[direction] = arrived
        connection.in_flight[direction].append((frames, nbytes))
        self.loop.call_at(arrived, self._arrive, connection, to_server)

    def _arrive(self, connection: _Connection, to_server: bool) -> None:
        frames, nbytes = connection.in_flight[0 if to_server else 1].popleft()
        dst = connection.server.host if to_server else connection.client.host
        done = dst.link.delivery(self.now(), nbytes)
        if done > self.now():
            self.loop.call_at(done, self._deliver, connection, frames, to_server)
        else:
            self._deliver(connection, frames, to_server)

    def _deliver(self, connection: _Connection, frames: list, to_server: bool) -> None:
        if to_server:
            server = connection.server
            if server.connections.get(connection.identity) is connection:
                first = (
                    SimFrame(connection.identity) if connection.user_id is None else caller_frame(connection)
                )
                server.deliver([first, *frames])
        else:
            client = connection.client
            if client.by_routing_id.get(connection.routing_id) is connection:
                client.deliver([SimFrame(connection.routing_id), *frames])
