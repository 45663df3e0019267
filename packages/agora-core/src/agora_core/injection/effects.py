"""What an obeyed injection does to the node: the actions, on the parts of a node they touch.

``exit`` and ``hang`` act on the process itself and are the same for every role. The others
need the role's parts: ``drop_link`` its RPC server and client (the DHT's traffic is on the
same port, so the node falls silent to everyone), ``slow`` its compute (a worker's compute
thread; a trainer's hops), ``nan`` the next gradient it sends (a worker's next backward
reply; a trainer's next backward request). A role without such a part ignores the action
and says so in the log.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from agora_core import world
from agora_core.injection.record import Action, Injection
from agora_core.observability.logs import get_logger

log = get_logger("injection")

HANG_SLICE_S = 3600.0  # a hang "for good" sleeps in slices this long, forever


@dataclass(kw_only=True)
class NodeEffects:
    """The role's handles on itself; None where the role has no such part."""

    drop_link: Callable[[float], None] | None = None  # seconds: no RPC in or out
    slow: Callable[[float, float], None] | None = None  # factor, seconds
    corrupt_next_gradient: Callable[[], None] | None = None

    def apply(self, injection: Injection) -> None:
        """Carry out ``injection``'s action now (an exit or a hang does not return soon)."""
        action = injection.action
        if action is Action.EXIT:
            crash(injection.exit_code)
        elif action is Action.HANG:
            hang(injection.duration_s)
        elif action is Action.SLOW and self.slow is not None:
            self.slow(injection.factor, injection.duration_s)
        elif action is Action.DROP_LINK and self.drop_link is not None:
            self.drop_link(injection.duration_s)
        elif action is Action.NAN and self.corrupt_next_gradient is not None:
            self.corrupt_next_gradient()
        else:
            log.warning("injection_not_applicable", record=injection.id, action=str(action))


def crash(code: int) -> None:
    """Die as a crash would: no cleanup, no LEFT announcement, no withdrawal. Only what was
    already written reaches the log (the obeyed line is flushed first, on purpose)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing to keep
            pass
    os._exit(code)


def hang(duration_s: float) -> None:
    """Stop answering: block the calling thread, the event loop's, so no RPC, DHT probe or
    timer runs, while the process stays alive (``duration_s`` 0: until killed)."""
    if duration_s > 0:
        time.sleep(duration_s)
        return
    while True:
        time.sleep(HANG_SLICE_S)


class Slowdown:
    """A compute slowdown the hot path reads as one float: ``factor`` until ``until``."""

    def __init__(self) -> None:
        self.factor = 1.0  # 1.0: off, the one value the hot path tests
        self._until = 0.0  # world.monotonic()

    def set(self, factor: float, duration_s: float) -> None:
        self._until = world.monotonic() + duration_s
        self.factor = factor

    def extra_s(self, elapsed_s: float) -> float:
        """How much longer a piece of work that took ``elapsed_s`` should take now."""
        if self.factor == 1.0:
            return 0.0
        if world.monotonic() >= self._until:
            self.factor = 1.0
            return 0.0
        return elapsed_s * (self.factor - 1.0)
