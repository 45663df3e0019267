"""What an RPC server keeps per registered method and per call in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from agora_core.auth.access import Access
from agora_core.errors import (
    BadRequest,
    DeadlineExceeded,
    HandlerFailed,
    LimitExceeded,
    Overloaded,
    RpcError,
    UnknownMethod,
    UnsupportedProtocolVersion,
    WireError,
)
from agora_core.observability.logs import get_logger
from agora_core.rpc.streams import ServerStream
from agora_core.rpc.types import Payload
from agora_core.wire.message import Kind, Message

log = get_logger("rpc.server")


def reject_reason(error: WireError) -> str:
    if isinstance(error, LimitExceeded):
        return "limit"
    if isinstance(error, UnsupportedProtocolVersion):
        return "version"
    return "malformed"


@dataclass(slots=True)
class Handler:
    fn: Callable
    streaming: bool
    window: int  # items a streaming caller may have in flight to it
    access: Access  # who may call it (checked with a security only)
    inline: bool = False  # a plain function: called on the receive path, no task


@dataclass(slots=True)
class Call:
    method: str
    task: asyncio.Task | None = None
    stream: ServerStream | None = None
    cancelled_by_peer: bool = False
    deadline_passed: bool = False
    timer: asyncio.TimerHandle | None = None  # cancels the task at the caller's deadline
    outcome: str = "cancelled"  # until the handler's task says otherwise
    started: float = 0.0

    def deadline_reached(self) -> None:
        self.deadline_passed = True
        self.task.cancel()


def response_message(rid: int, result) -> Message:
    """The reply carrying what a handler returned (a Payload, or None for an empty one)."""
    if result is None:
        result = Payload()
    elif not isinstance(result, Payload):
        raise HandlerFailed(f"handler returned {type(result).__name__}; expected Payload or None")
    return Message(kind=Kind.RESPONSE, request_id=rid, meta=result.meta, tensors=result.tensors)


def error_message(rid: int, error: RpcError) -> Message:
    return Message(kind=Kind.ERROR, request_id=rid, error_code=error.code, error_message=str(error)[:4000])


def handler_failure(method: str, exc: Exception) -> RpcError:
    """What a handler's exception tells its caller: its typed error, or that it failed."""
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, WireError):  # the handler found the caller's data inconsistent
        return BadRequest(str(exc))
    log.warning("handler_failed", method=method, error=f"{type(exc).__name__}: {exc}")  # a bug
    return HandlerFailed(f"{type(exc).__name__}: {exc}")


def refusal_before_start(
    message: Message,
    handler: Handler | None,
    *,
    duplicate: bool,
    served: Iterable[str],
    busy: str | None,
    remaining_s: float,
) -> tuple[str, RpcError] | None:
    """Why a request is answered without running a handler (the rejection counter's reason and
    the caller's error), or None. ``busy``: why the server takes no more calls now."""
    if duplicate:
        return "duplicate", BadRequest(f"request id {message.request_id} is already in flight")
    if handler is None:
        listed = ", ".join(sorted(served)) or "nothing"
        return "unknown_method", UnknownMethod(f"no method {message.method!r} here; serving: {listed}")
    if busy is not None:
        return "overloaded", Overloaded(f"server refused the request: {busy}")
    if remaining_s <= 0:
        return "expired", DeadlineExceeded("request arrived after its deadline")
    return None
