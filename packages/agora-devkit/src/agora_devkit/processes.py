"""Child processes and waiting with deadlines, for Agora's tests and benchmarks.

Tests never sleep for a fixed time: they wait for a condition with a deadline. Every process
a test starts is stopped when the ``with`` block ends, whatever happened inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

POLL_INTERVAL_S = 0.005


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout_s: float = 10.0,
    what: str = "condition",
    every_s: float = POLL_INTERVAL_S,
) -> None:
    """Block until ``predicate()`` is true, checking every ``every_s`` (longer for a check that
    asks another process); TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


async def wait_until_async(
    predicate: Callable[[], bool], *, timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """``wait_until`` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(POLL_INTERVAL_S)


async def poll_until(
    check: Callable[[], Awaitable[bool]],
    *,
    timeout_s: float = 10.0,
    what: str = "condition",
    every_s: float = 0.05,
) -> None:
    """Await ``check()`` (say, an RPC to another process) until it is true, with a deadline."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(every_s)


class ChildProcess:
    """A child Python process whose stdout lines can be awaited; see :func:`spawn_python`."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.lines: list[str] = []
        self._pending = b""  # bytes read from stdout that do not yet end a line

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_until(self, prefix: str, *, timeout_s: float = 30.0) -> str:
        """Read stdout until a line starting with ``prefix``; return the rest of that line."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._pending:
                raw, self._pending = self._pending.split(b"\n", 1)
                line = raw.decode(errors="replace")
                self.lines.append(line)
                if line.startswith(prefix):
                    return line[len(prefix) :].strip()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"child {self.pid} printed no {prefix!r} line in {timeout_s:g} s")
            poller = select.poll()  # not select(): descriptors above 1023 are common in swarms
            poller.register(fd, select.POLLIN | select.POLLHUP)
            if not poller.poll(remaining * 1000):
                continue
            chunk = os.read(fd, 65536)  # unbuffered: select and reads agree on what is pending
            if not chunk:
                raise RuntimeError(
                    f"child {self.pid} exited (code {self.proc.wait()}) before printing {prefix!r}"
                )
            self._pending += chunk

    def kill(self) -> None:
        """SIGKILL: the abrupt death of a node."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)

    def begin_stop(self) -> None:
        """Close stdin and send SIGTERM (a child may stop on either), without waiting: several
        children stop at once, then :meth:`stop` waits for each."""
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, *, timeout_s: float = 10.0) -> int:
        """:meth:`begin_stop`, then SIGKILL after ``timeout_s``; returns the exit code."""
        self.begin_stop()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def spawn_python(args: Sequence[str], *, env: dict[str, str] | None = None) -> Iterator[ChildProcess]:
    """Run ``python args...`` with piped stdin/stdout; always stopped when the block exits."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    child = ChildProcess(proc)
    try:
        yield child
    finally:
        child.stop()
        if proc.stdout is not None:
            proc.stdout.close()
