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
import heapq
import itertools
import selectors

_LONGEST_JUMP_S = 24 * 3600.0  # asyncio's longest wait in one pass, kept so passes match


class SimulationStalled(RuntimeError):
    """Nothing is ready and no timer is due: the simulated world would wait forever."""


class _VirtualSelector(selectors.DefaultSelector):
    """Polls the loop's real descriptors (its own wake-up pipe) without blocking; a wait for
    ``timeout`` seconds becomes a jump of the virtual clock.

    Nothing but another thread writes to that pipe, and the simulator keeps threads out, so
    while callbacks are ready it is polled only every ``BUSY_POLL_EVERY``-th pass (a system
    call per pass was a few per cent of a large run); before the clock jumps, always."""

    BUSY_POLL_EVERY = 64

    def __init__(self, clock: VirtualClock):
        super().__init__()
        self._clock = clock
        self._busy_passes = 0

    def select(self, timeout: float | None = None):
        if timeout == 0:
            self._busy_passes += 1
            if self._busy_passes < self.BUSY_POLL_EVERY:
                return []
        self._busy_passes = 0
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
        # the reading itself, kept up to date: the loop reads it a dozen times a message
        self.monotonic_s = monotonic_start_s

    def advance(self, seconds: float) -> None:
        self.elapsed_s += seconds
        self.monotonic_s = self._monotonic_start_s + self.elapsed_s

    def monotonic(self) -> float:
        return self.monotonic_s

    def wall(self) -> float:
        return self._wall_start_s + self.elapsed_s


class VirtualLoop(asyncio.SelectorEventLoop):
    """The simulator's event loop: ``time()`` is :class:`VirtualClock`'s monotonic reading.

    Its timers sit in a heap of ``(when, order made, handle)`` tuples rather than asyncio's
    heap of handles: the tuples compare in C where handles compare through a Python
    ``__lt__`` (with the heap's pops, about a tenth of a large run's real time), and ties
    run in the order they were made, as the module says. The pass below is asyncio's own
    (CPython 3.11's ``BaseEventLoop._run_once``: its ready queue, stop flag and count of
    cancelled timers) over that heap; asyncio's ``_scheduled`` list stays empty."""

    def __init__(self, clock: VirtualClock):
        self.clock = clock
        super().__init__(_VirtualSelector(clock))
        self.set_debug(False)  # slow-callback warnings measure real time: meaningless here
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._made = itertools.count()

    def time(self) -> float:
        return self.clock.monotonic_s

    def call_at(self, when, callback, *args, context=None) -> asyncio.TimerHandle:
        if when is None:
            raise TypeError("when cannot be None")
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._timers, (when, next(self._made), timer))
        timer._scheduled = True
        return timer

    def close(self) -> None:
        self._timers.clear()
        super().close()

    def _run_once(self) -> None:
        """asyncio's own pass (drop cancelled timers, poll, move due timers to ready, run what
        was ready), over the tuple heap."""
        timers = self._timers
        if len(timers) > 100 and 2 * self._timer_cancelled_count > len(timers):
            kept = []
            for entry in timers:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    kept.append(entry)
            heapq.heapify(kept)
            self._timers = timers = kept
            self._timer_cancelled_count = 0
        else:
            while timers and timers[0][2]._cancelled:
                self._timer_cancelled_count -= 1
                heapq.heappop(timers)[2]._scheduled = False
        if self._ready or self._stopping:
            timeout = 0
        elif timers:
            timeout = min(max(0, timers[0][0] - self.time()), _LONGEST_JUMP_S)
        else:
            timeout = None
        self._process_events(self._selector.select(timeout))
        due = self.time() + self._clock_resolution
        ready = self._ready
        while timers and timers[0][0] < due:
            handle = heapq.heappop(timers)[2]
            handle._scheduled = False
            ready.append(handle)
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()
