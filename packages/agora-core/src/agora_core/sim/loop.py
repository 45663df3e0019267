"""An asyncio event loop whose clock is virtual: when nothing is ready, time jumps to the next
timer instead of waiting for it.

Everything asyncio times (``asyncio.sleep``, ``asyncio.timeout``, ``loop.call_at``) follows
``loop.time()``, so the real code's sleeps, deadlines and periodic tasks run in virtual time
without a change. Callbacks run in the order asyncio gives them (ready ones first-in first-out,
timers by due time, ties in the order they were made), which is deterministic as long as
nothing outside the loop adds work: the simulator keeps threads and real sockets out.
"""

from __future__ import annotations

import asyncio
import selectors


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is due: the simulated world would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls the loop's real descriptors (its own wake-up pipe) without blocking; a wait for
    ``timeout`` seconds becomes a jump of the virtual clock."""

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None):
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise SimulationStalled(
                "the simulation has nothing ready and no timer due (every task waits on something that never comes)"
            )
        if timeout > 0:
            self._clock.advance(timeout)
        return ready


class VirtualClock:
    """Virtual seconds since the simulation began, plus the offsets that make ``monotonic`` and
    ``wall`` readings look like a real machine's."""

    def __init__(self, *, monotonic_start_s: float = 1000.0, wall_start_s: float = 1_780_000_000.0):
        self.elapsed_s = 0.0
        self._monotonic_start_s = monotonic_start_s
        self._wall_start_s = wall_start_s

    def advance(self, seconds: float) -> None:
        self.elapsed_s += seconds

    def monotonic(self) -> float:
        return self._monotonic_start_s + self.elapsed_s

    def wall(self) -> float:
        return self._wall_start_s + self.elapsed_s


class VirtualLoop(asyncio.SelectorEventLoop):
    """The simulator's event loop: ``time()`` is :class:`VirtualClock`'s monotonic reading."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        super().__init__(_VirtualSelector(clock))
        self.set_debug(False)  # slow-callback warnings measure real time: meaningless here

    def time(self) -> float:
        return self.clock.monotonic()
