"""What Linux's /proc says about a process or one of its threads: its name, state, parent, CPU
time and start time (``stat``), and the scheduler's running and waiting times (``schedstat``).
Every reader returns None once the process is gone, or where there is no /proc. The local
swarm tells a process from a later one that reuses its pid by its start time; the benchmarks
account CPU and find the processes they started with the rest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    name: str  # the command name (a thread's own, where it set one)
    state: str  # R, S, D, Z (a zombie: dead, not reaped yet), ...
    ppid: int
    cpu_s: float  # user + system
    started: int  # clock ticks after boot


def stat(pid: int, tid: int | None = None) -> Stat | None:
    """Process ``pid``'s stat, or its thread ``tid``'s."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    # the name may hold spaces and parentheses: the fields follow the last ")"
    fields = text.rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    name = text[text.index("(") + 1 : text.rindex(")")]
    return Stat(name, fields[0], int(fields[1]), cpu_s, int(fields[19]))  # fields 3, 4, 14+15, 22


def schedstat(pid: int, tid: int) -> tuple[int, int] | None:
    """Thread ``tid``'s (ns running, ns runnable but waiting for a core) so far."""
    try:
        running, waiting, _slices = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
    except OSError:
        return None
    return int(running), int(waiting)


def pids() -> list[int]:
    """Every process's pid (empty where there is no /proc)."""
    try:
        return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except FileNotFoundError:
        return []


def threads(pid: int) -> list[int]:
    """The thread ids of ``pid`` (empty once it is gone)."""
    try:
        return [int(entry) for entry in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []
