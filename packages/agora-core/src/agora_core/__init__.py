"""agora-core: wire format, RPC, link emulation, configuration, logging and metrics."""

from agora_core.errors import (
    AgoraError,
    BadRequest,
    ConfigError,
    DeadlineExceeded,
    HandlerFailed,
    LimitExceeded,
    MalformedMessage,
    Overloaded,
    PeerUnreachable,
    RpcError,
    StageMismatch,
    StreamError,
    UnknownMethod,
    UnsupportedProtocolVersion,
    WireError,
)
from agora_core.wire.dtypes import SUPPORTED_DTYPES, TaggedArray

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_DTYPES",
    "AgoraError",
    "BadRequest",
    "ConfigError",
    "DeadlineExceeded",
    "HandlerFailed",
    "LimitExceeded",
    "MalformedMessage",
    "Overloaded",
    "PeerUnreachable",
    "RpcError",
    "StageMismatch",
    "StreamError",
    "TaggedArray",
    "UnknownMethod",
    "UnsupportedProtocolVersion",
    "WireError",
    "__version__",
]
