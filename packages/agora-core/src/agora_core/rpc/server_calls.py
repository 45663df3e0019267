"""What an RPC server keeps per registered method and per call in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from agora_core.auth.access import Access
from agora_core.errors import LimitExceeded, UnsupportedProtocolVersion, WireError
from agora_core.rpc.streams import ServerStream


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
