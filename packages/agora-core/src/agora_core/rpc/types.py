"""What RPC handlers receive and return, and the RPC layer's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agora_core import world
from agora_core.auth.peer_identity import PeerIdentity
from agora_core.wire.dtypes import Tensor
from agora_core.wire.message import WireConfig


@dataclass(kw_only=True, frozen=True)
class RpcConfig:
    wire: WireConfig = field(default_factory=WireConfig)
    default_timeout_s: float = 30.0  # per call, when the caller names none
    connect_timeout_s: float = 5.0  # how long a call waits for a connection before PeerUnreachable
    max_inflight_requests: int = 1024  # per server; beyond it requests are answered Overloaded
    stream_window: int = 4  # stream items a receiver lets its peer have in flight ([transport]'s default)
    max_connections: int = 256  # client connection pool size; idle ones are evicted LRU
    high_water_mark: int = 1000  # zmq messages queued per socket and peer
    reconnect_interval_s: float = 0.1  # first zmq reconnect delay; backs off to 20x

    def window(self, requested: int | None) -> int:
        """The stream window a method or caller asked for (None: this config's)."""
        if requested is None:
            return self.stream_window
        if not isinstance(requested, int) or isinstance(requested, bool) or requested < 1:
            raise ValueError(f"a stream window is a positive item count, got {requested!r}")
        return requested

    def __post_init__(self) -> None:
        positive = ("default_timeout_s", "connect_timeout_s", "reconnect_interval_s")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"RpcConfig.{name} must be positive")
        for name in ("max_inflight_requests", "stream_window", "max_connections", "high_water_mark"):
            if getattr(self, name) < 1:
                raise ValueError(f"RpcConfig.{name} must be >= 1")


@dataclass(slots=True)
class Payload:
    """Metadata (any msgpack-able value) plus named tensors: a reply or one stream item."""

    meta: Any = None
    tensors: dict[str, Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class Request:
    """One incoming call as a handler sees it."""

    method: str
    meta: Any
    tensors: dict[str, Tensor]
    # the caller's node id: authenticated in an authorized run ("" for a caller without a
    # credential), as the caller declared it in an open one
    sender: str
    peer: bytes  # transport identity of the connection; opaque
    deadline: float  # world.monotonic() by which the caller stops waiting
    caller: PeerIdentity | None = None  # who the caller is (authorized runs): role, stage, key

    @property
    def remaining_s(self) -> float:
        return self.deadline - world.monotonic()


@dataclass(slots=True)
class Traffic:
    """Messages and bytes through one socket, as plain counters (cheap to read)."""

    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0

    def sent(self, nbytes: int) -> None:
        self.messages_sent += 1
        self.bytes_sent += nbytes

    def received(self, nbytes: int) -> None:
        self.messages_received += 1
        self.bytes_received += nbytes

    def bytes_by_direction(self) -> dict[tuple[str, ...], float]:
        """The byte totals as a metrics reading (``NodeMetrics.counter_from``)."""
        return {("sent",): self.bytes_sent, ("received",): self.bytes_received}
