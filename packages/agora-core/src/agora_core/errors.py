"""Typed errors shared by every Agora package.

Errors that cross the network carry a stable string ``code``; the receiving side maps it back
to the same class with :func:`rpc_error_from_code`, so a caller catches ``DeadlineExceeded``
whether the deadline ran out locally or on the remote node.
"""

from __future__ import annotations


class AgoraError(Exception):
    """Base class of every error Agora raises on purpose."""


class ConfigError(AgoraError):
    """A run config or node setting is missing, mistyped or out of range.

    ``key`` is the dotted path of the offending setting (``averaging.segments``), so the
    message can point the user at the exact line to fix.
    """

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}" if key else reason)


# --- wire format -------------------------------------------------------------------------


class WireError(AgoraError):
    """A message could not be encoded or decoded."""


class MalformedMessage(WireError):
    """A message is truncated, garbled, or inconsistent with its own header."""


class LimitExceeded(WireError):
    """A message declares more than the configured limits allow (checked before allocation)."""


class UnsupportedProtocolVersion(WireError):
    """A peer speaks a protocol major version this node does not understand."""


# --- RPC ----------------------------------------------------------------------------------


class RpcError(AgoraError):
    """An RPC failed. ``code`` travels on the wire; ``remote`` says who raised it."""

    code = "rpc_error"

    def __init__(self, message: str = "", *, remote: bool = False) -> None:
        self.remote = remote
        super().__init__(message)


class UnknownMethod(RpcError):
    """The server has no handler registered under the requested method name."""

    code = "unknown_method"


class BadRequest(RpcError):
    """The request was malformed or its arguments were rejected by the handler."""

    code = "bad_request"


class StageMismatch(BadRequest):
    """A request for one pipeline stage reached a worker of another."""

    code = "stage_mismatch"


class HandlerFailed(RpcError):
    """The handler raised an unexpected exception; the message names its type and text."""

    code = "handler_failed"


class DeadlineExceeded(RpcError):
    """The call's deadline passed before a reply arrived."""

    code = "deadline_exceeded"


class PeerUnreachable(RpcError):
    """No connection to the peer could be made, or it was lost while the call was pending."""

    code = "peer_unreachable"


class Overloaded(RpcError):
    """The server refused the request because too many are already in flight."""

    code = "overloaded"


class NotServing(RpcError):
    """The worker is joining its stage (downloading state, weight sync) and serves no batches."""

    code = "not_serving"


class StreamError(RpcError):
    """A stream broke its protocol: sent without credit, after its end, or out of order."""

    code = "stream_error"


class Unauthenticated(RpcError):
    """The caller holds no valid credential of this run (none, forged, another run's, expired,
    revoked, issued to another key), or its clock is off beyond the run's limit."""

    code = "unauthenticated"


class Forbidden(RpcError):
    """The caller is credentialed, but its role or stage may not call this method."""

    code = "forbidden"


class PeerRefused(PeerUnreachable):
    """The connection was refused: the node there does not hold the key or credential expected
    of it, or it refused ours. Callers treat it as they treat an unreachable peer."""

    code = "peer_refused"


_RPC_ERRORS: dict[str, type[RpcError]] = {
    cls.code: cls
    for cls in (
        RpcError,
        UnknownMethod,
        BadRequest,
        StageMismatch,
        HandlerFailed,
        DeadlineExceeded,
        PeerUnreachable,
        Overloaded,
        NotServing,
        StreamError,
        Unauthenticated,
        Forbidden,
        PeerRefused,
    )
}


def rpc_error_from_code(code: str, message: str) -> RpcError:
    """Rebuild the typed error a remote node reported; unknown codes become ``RpcError``."""
    cls = _RPC_ERRORS.get(code, RpcError)
    text = message if cls is not RpcError or code == RpcError.code else f"[{code}] {message}"
    return cls(text, remote=True)
