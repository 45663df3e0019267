"""Where a local swarm's CPU goes: every member's threads, sampled from /proc while the swarm
runs, summed by role and thread kind over a window of the run.

Thread kinds: ``event_loop`` (a node's main thread: its asyncio loop, which handles messages,
the DHT, progress reports and averaging's bookkeeping), ``zmq_io`` (libzmq's background I/O
threads) and ``threads`` (every other thread: a worker's compute thread, which runs the
stage's forward and backward and the optimizer, and executor threads). Linux only; elsewhere
it accounts nothing.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from agora_localswarm import proc

PERIOD_S = 0.25  # sampling period: short against a training window of tens of seconds


@dataclass
class ThreadSeries:
    role: str
    kind: str
    times: list[float] = field(default_factory=list)  # time.time() of each sample
    cpu: list[float] = field(default_factory=list)  # the thread's CPU seconds then

    def at(self, when: float) -> float:
        """CPU seconds used by ``when`` (the nearest sample at or before it; 0 before the first)."""
        index = bisect.bisect_right(self.times, when) - 1
        return self.cpu[index] if index >= 0 else 0.0


class CpuAccount:
    """Samples the threads of the members listed in ``run_dir/swarm.json`` until stopped."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.series: dict[tuple[int, int], ThreadSeries] = {}  # (pid, tid) -> its samples
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-account", daemon=True)

    def __enter__(self) -> CpuAccount:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            self.sample()

    def sample(self) -> None:
        now = time.time()
        for pid, role in self._members().items():
            for tid, kind, cpu in _threads(pid):
                series = self.series.setdefault((pid, tid), ThreadSeries(role, kind))
                series.times.append(now)
                series.cpu.append(cpu)

    def _members(self) -> dict[int, str]:
        try:
            members = json.loads((self.run_dir / "swarm.json").read_text())["members"]
        except (OSError, ValueError, KeyError):
            return {}  # not written yet, or mid-rewrite
        return {m["pid"]: m["role"] for m in members}

    def between(self, start: float, end: float) -> dict[tuple[str, str], float]:
        """CPU seconds each (role, thread kind) used between two ``time.time()`` instants."""
        used: dict[tuple[str, str], float] = {}
        for series in self.series.values():
            key = (series.role, series.kind)
            used[key] = used.get(key, 0.0) + series.at(end) - series.at(start)
        return used


def _threads(pid: int) -> list[tuple[int, str, float]]:
    """(tid, kind, CPU seconds) of each thread of ``pid``; empty once it is gone."""
    found = []
    for tid in proc.threads(pid):
        stat = proc.stat(pid, tid)
        if stat is not None:
            kind = "event_loop" if tid == pid else "zmq_io" if stat.name.startswith("ZMQbg") else "threads"
            found.append((tid, kind, stat.cpu_s))
    return found
