"""What every benchmark shares besides its figures: the ``--json``, ``--smoke`` and
``--deadline-s`` arguments, and a deadline on the whole run.

``--smoke`` runs the benchmark at tiny sizes in a few seconds; the test command runs every
benchmark that way, so an API change fails CI instead of rotting the benchmark. The deadline
covers everything the benchmark waits for, its child processes included: when it passes, the
benchmark says what it was waiting for (the last :func:`waiting_for`, or the last
``Report.note``), stops every process it started, and exits with :data:`DEADLINE_EXIT`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from agora_localswarm import proc

DEADLINE_EXIT = 3
SMOKE_DEADLINE_S = 150.0  # a smoke run takes seconds; this only catches a hang
_STOP_GRACE_S = 5.0  # between SIGTERM and SIGKILL for the processes left at the deadline

_state = {"doing": "the benchmark to start", "title": Path(sys.argv[0]).stem}


def add_arguments(parser: argparse.ArgumentParser, *, deadline_s: float) -> None:
    """The arguments every benchmark takes; ``deadline_s`` is the full run's default."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the benchmark runs, measures nothing",
    )
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help=f"give up (exit {DEADLINE_EXIT}) after this long "
        f"(default {deadline_s:g} s, {SMOKE_DEADLINE_S:g} s with --smoke)",
    )
    parser.set_defaults(full_deadline_s=deadline_s)


def parse(parser: argparse.ArgumentParser, *, smoke: dict[str, object]) -> argparse.Namespace:
    """Parse the command line; with ``--smoke``, ``smoke``'s values replace the arguments of
    the same names. Arms the deadline, except in a benchmark's own child process (``--serve``)."""
    args = parser.parse_args()
    if getattr(args, "serve", None):
        return args  # the benchmark's own child process (--serve): its parent's deadline stops it
    if args.smoke:
        for name, value in smoke.items():
            if not hasattr(args, name):
                raise AttributeError(f"--smoke sets {name!r}, which is not an argument")
            setattr(args, name, value)
    if args.deadline_s is None:
        args.deadline_s = SMOKE_DEADLINE_S if args.smoke else args.full_deadline_s
    arm(args.deadline_s)
    return args


def waiting_for(text: str) -> None:
    """What the benchmark waits for now: printed if the deadline passes meanwhile."""
    _state["doing"] = text


def arm(deadline_s: float) -> None:
    """Exit after ``deadline_s`` seconds, whatever the main thread is blocked on."""
    started = time.monotonic()
    expiring = threading.Event()

    def expire() -> None:
        expiring.set()
        print(
            f"{_state['title']}: no result within {deadline_s:g} s "
            f"(after {time.monotonic() - started:.0f} s); it was waiting for: {_state['doing']}",
            file=sys.stderr,
            flush=True,
        )
        stop_descendants()
        os._exit(DEADLINE_EXIT)

    def exit_with_the_deadline() -> None:
        # the main thread may fail and exit first, as the processes it waits on are stopped
        if expiring.is_set():
            time.sleep(_STOP_GRACE_S + 5)  # expire() ends the process meanwhile
            os._exit(DEADLINE_EXIT)

    atexit.register(exit_with_the_deadline)
    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.start()


def stop_descendants() -> None:
    """SIGTERM every process this one started (children of children too, also those in
    their own sessions), then SIGKILL those still there after a grace period."""
    pids = _descendants(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    until = time.monotonic() + _STOP_GRACE_S
    while time.monotonic() < until and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _descendants(root: int) -> list[int]:
    """Pids below ``root`` in the process tree (empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for pid in proc.pids():
        found = proc.stat(pid)
        if found is not None:
            children.setdefault(found.ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _alive(pid: int) -> bool:
    found = proc.stat(pid)
    return found is not None and found.state != "Z"  # a zombie is dead, just not reaped yet
