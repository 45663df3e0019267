"""A progress bar for long data jobs: redrawn in place on a terminal, a line now and then in a log."""

from __future__ import annotations

import sys
from typing import TextIO

from agora_core import world

WIDTH = 24  # characters of bar


class ProgressBar:
    def __init__(self, label: str, *, stream: TextIO | None = None, log_every_s: float = 5.0):
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every_s = 0.2 if self.tty else log_every_s  # a log gets a line, not a redraw storm
        self.started = world.monotonic()
        self._last = 0.0

    def update(self, done: float, total: float, *, what: str = "", force: bool = False) -> None:
        """``done`` of ``total`` (any unit, shown as a share); ``what``: text after the bar."""
        now = world.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        share = min(1.0, done / total) if total > 0 else 0.0
        filled = round(share * WIDTH)
        bar = "#" * filled + "-" * (WIDTH - filled)
        line = f"  {self.label} [{bar}] {share:4.0%} {what} ({now - self.started:.1f} s)"
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")  # clear what a longer line left behind
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self, done: float, total: float, *, what: str = "") -> None:
        self.update(done, total, what=what, force=True)
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
