"""`swarm.py down` and `kill-worker` act on the processes the swarm started, never on another
process that got one of their pids after they ended (pids come round again quickly on a busy
machine: a benchmark's tokenizing worker, say)."""

from __future__ import annotations

import subprocess
import sys

from agora_localswarm.processes import Member, SwarmFile, alive, kill_last_worker, process_start, stop_all


def start_sleeper() -> subprocess.Popen:
    """A process that lives until its stdin closes or it is signalled."""
    return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)


def swarm_with(tmp_path, proc: subprocess.Popen, started: int) -> SwarmFile:
    member = Member("worker", "worker-0", proc.pid, str(tmp_path / "worker-0.log"), stage=0, started=started)
    swarm = SwarmFile(run_dir=str(tmp_path), config="", members=[member])
    swarm.save()
    return swarm


def test_a_reused_pid_is_neither_alive_nor_killed(tmp_path):
    stranger = start_sleeper()  # holds the pid a swarm member once had
    try:
        started = process_start(stranger.pid)
        assert started > 0
        swarm = swarm_with(tmp_path, stranger, started=started - 1)  # the member started earlier
        assert not alive(stranger.pid, started - 1)
        assert kill_last_worker(swarm, 0) is None
        stop_all(SwarmFile.load(tmp_path), timeout_s=5)
        assert stranger.poll() is None, "down stopped a process the swarm never started"
    finally:
        stranger.kill()
        stranger.communicate(timeout=10)


def test_down_still_stops_the_members_it_started(tmp_path):
    member = start_sleeper()
    try:
        swarm = swarm_with(tmp_path, member, started=process_start(member.pid))
        assert alive(member.pid, swarm.members[0].started)
        stop_all(SwarmFile.load(tmp_path), timeout_s=5)  # a swarm.json written by `up`, read back
        assert not alive(member.pid, swarm.members[0].started)  # stop_all reaps it: its status is gone
    finally:
        member.kill()
        member.communicate(timeout=10)
