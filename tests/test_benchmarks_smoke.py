"""Every benchmark runs in its ``--smoke`` mode: tiny sizes, a few seconds, figures checked for
shape, not for speed. An API change that breaks a benchmark fails here, not months later in
a user's hands. The deadline is the benchmark's own (``benchmarks/_harness.py``); the test's
is a backstop a little longer, after which it kills the benchmark's whole process group."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agora_devkit.benchmark_results import benchmark_names

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


SMOKE_DEADLINE_S = 150  # benchmarks/_harness.py's SMOKE_DEADLINE_S
BACKSTOP_S = SMOKE_DEADLINE_S + 30
PARALLEL = 2  # smoke runs at a time
# Smoke runs that start a swarm or several worker processes: each keeps both cores busy.
HEAVY = {"ablation_backward", "byzantine", "churn", "convergence", "efficiency", "join", "preemption"}
# Benchmarks that another test runs whole, named with that test.
RUN_ELSEWHERE = {"join_churn": "tests/test_swarm_join_churn.py runs it for one seed"}


def test_every_benchmark_is_smoked_or_run_elsewhere():
    names = benchmark_names()
    assert "transport" in names and "dht" in names, names  # the glob found the folder
    assert set(RUN_ELSEWHERE) <= set(names), "a benchmark named in RUN_ELSEWHERE no longer exists"
    assert HEAVY <= set(names), "a benchmark named in HEAVY no longer exists"
    for name in names:
        source = (BENCHMARKS / f"{name}.py").read_text()
        assert "_harness.parse(" in source, f"benchmarks/{name}.py does not parse its arguments with _harness"


@dataclass
class SmokeRun:
    returncode: int | None  # None: it outlived the backstop
    out: str
    err: str


def run_smoke(name: str) -> SmokeRun:
    proc = subprocess.Popen(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--smoke", "--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the backstop below stops all of it
    )
    timed_out = False
    try:
        out, err = proc.communicate(timeout=BACKSTOP_S)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.returncode is None:  # not reaped yet, so its group id is still its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=30)
    return SmokeRun(None if timed_out else proc.returncode, out, err)


class SmokeQueue:
    """Runs the smoke runs PARALLEL at a time, in order, but at most one of the HEAVY at a time:
    while one runs, the next light one goes ahead of a waiting heavy one (two heavy ones on two
    cores slow each other to their deadlines)."""

    def __init__(self, names: list[str]):
        self.futures: dict[str, concurrent.futures.Future] = {
            name: concurrent.futures.Future() for name in names
        }
        self._pending = list(names)
        self._heavy_running = False
        self._closed = False
        self._changed = threading.Condition()
        self._threads = [threading.Thread(target=self._work, daemon=True) for _ in range(PARALLEL)]
        for thread in self._threads:
            thread.start()

    def _take(self) -> str | None:
        """The next run this thread may start, once it may (None: none left, or closed)."""
        with self._changed:
            while not self._closed and self._pending:
                for name in self._pending:
                    if name not in HEAVY or not self._heavy_running:
                        self._pending.remove(name)
                        self._heavy_running |= name in HEAVY
                        return name
                # only heavy ones left, one running: it ends within its backstop
                self._changed.wait(timeout=BACKSTOP_S + 30)
            return None

    def _work(self) -> None:
        while (name := self._take()) is not None:
            try:
                self.futures[name].set_result(run_smoke(name))
            except BaseException as exc:  # the test that waits for it reports it
                self.futures[name].set_exception(exc)
            finally:
                with self._changed:
                    self._heavy_running &= name not in HEAVY
                    self._changed.notify_all()

    def close(self) -> None:
        """Start nothing more; the started runs finish within their backstop."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=BACKSTOP_S + 60)


@pytest.fixture(scope="module")
def smoke_runs(request) -> Iterator[dict[str, concurrent.futures.Future]]:
    """The smoke runs of the benchmarks this session selected, started in the order their
    tests run (``SmokeQueue``): each test then waits about as long as its own run. Most of a
    light run's time is start-up and waiting, so it shares the two cores well."""
    selected = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.originalname == "test_benchmark_smoke" and hasattr(item, "callspec")
    ]
    queue = SmokeQueue(selected)
    try:
        yield queue.futures
    finally:
        queue.close()


@pytest.mark.slow
@pytest.mark.timeout(BACKSTOP_S + 60)
@pytest.mark.parametrize("name", [n for n in benchmark_names() if n not in RUN_ELSEWHERE])
def test_benchmark_smoke(name, smoke_runs):
    # the runs before this test's have finished, as their tests did: it waits for its own
    run = smoke_runs[name].result(timeout=BACKSTOP_S + 30)
    if run.returncode is None:
        pytest.fail(
            f"{name} --smoke outlived its own deadline by {BACKSTOP_S - SMOKE_DEADLINE_S} s\n{run.err[-3000:]}"
        )
    assert run.returncode == 0, f"{name} --smoke exited {run.returncode}\n{run.err[-4000:]}"
    lines = [line for line in run.out.splitlines() if line.startswith("{")]
    assert lines, f"{name} --smoke --json printed no JSON object:\n{run.out[-2000:]}\n{run.err[-2000:]}"
    result = json.loads(lines[-1])
    assert result["benchmark"], result
    assert result["figures"], f"{name} --smoke reported no figure"
    for figure in result["figures"]:
        assert figure["name"] and figure["unit"], figure
        assert math.isfinite(figure["value"]), f"{name}: {figure['name']} is {figure['value']}"


def test_the_readme_table_shows_the_saved_results():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "benchmark_results.py"), "table", "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``marker`` (this user's: /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "environ").read_bytes():
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the processes left through /proc")
def test_a_benchmark_past_its_deadline_says_what_it_waited_for_and_stops_everything():
    marker = f"AGORA_DEADLINE_TEST={os.getpid()}-{time.monotonic_ns()}"
    name, value = marker.split("=")
    # routing measures for 60 s behind a child process serving its stages: the deadline comes first
    command = [sys.executable, str(BENCHMARKS / "routing.py"), "--lanes", "2", "--stages", "2"]
    command += ["--seconds", "60", "--deadline-s", "8"]
    started = time.monotonic()
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=90, env={**os.environ, name: value}
    )
    assert done.returncode == 3, (done.returncode, done.stderr[-3000:])
    assert time.monotonic() - started < 40
    assert "no result within 8 s" in done.stderr and "waiting for: 2 lanes" in done.stderr, done.stderr[
        -3000:
    ]
    assert processes_with(marker) == []  # its serving child too
