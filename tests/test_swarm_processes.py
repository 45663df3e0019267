"""The local swarm's processes: `swarm.py down` and `kill-worker` act on the processes the swarm
started, never on another process that got one of their pids after they ended (pids come round
again quickly on a busy machine: a benchmark's tokenizing worker, say); runs starting together
share the checkout's shards without writing them twice, and a run needing more never leaves
the others a half-made set."""

from __future__ import annotations

import subprocess
import sys
import time

from agora_core.config import load_run_config
from agora_devkit.runs import tiny_run_toml
from agora_localswarm.processes import Member, SwarmFile, alive, kill_last_worker, process_start, stop_all
from agora_trainer.data.shards import open_shard_set


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


ENSURE = "import sys; from pathlib import Path; from agora_localswarm.cli import ensure_shards; ensure_shards(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if sys.argv[3:] else 64)"


def test_runs_starting_at_once_make_the_shared_shards_once(tmp_path):
    """Two runs of the checkout start together and both need its shards: one makes them while
    the other waits for the lock, then finds them (two writers renamed each other's files)."""
    config = tmp_path / "run.toml"
    config.write_text(tiny_run_toml("shared-shards"))
    shards = tmp_path / "shards" / "bytes"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENSURE, str(shards), str(config)], stdout=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        outs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outs
    assert sum("making data shards" in out for out in outs) == 1, outs
    assert open_shard_set(shards, "train").shards and open_shard_set(shards, "validation").shards


def test_a_set_too_small_for_a_later_run_is_replaced_whole(tmp_path):
    """A run needing more samples than the shared set holds makes a bigger one; meanwhile the
    folder holds the old complete set (a trainer reading it once found shard files and no
    manifest, and failed), then the new one."""
    config = tmp_path / "run.toml"
    config.write_text(tiny_run_toml("bigger-shards"))
    shards = tmp_path / "shards" / "bytes"
    subprocess.run([sys.executable, "-c", ENSURE, str(shards), str(config)], check=True, timeout=120)
    seq_len = load_run_config(config).model.seq_len
    held = sum(s.sample_count(seq_len) for s in open_shard_set(shards, "train").shards)
    bigger = subprocess.Popen([sys.executable, "-c", ENSURE, str(shards), str(config), str(2 * held)])
    seen_half_made = 0
    try:
        deadline = time.monotonic() + 120
        while bigger.poll() is None and time.monotonic() < deadline:
            files = {p.name for p in shards.iterdir()} if shards.exists() else set()
            seen_half_made += bool(files) and "manifest.json" not in files
            time.sleep(0.005)  # sampling the folder as a starting trainer would, not a wait
        assert bigger.wait(timeout=1) == 0
    finally:
        bigger.kill()
    assert seen_half_made == 0
    assert sum(s.sample_count(seq_len) for s in open_shard_set(shards, "train").shards) > held
    leftovers = [
        p.name for p in shards.parent.iterdir() if p.name.startswith((".bytes.making", ".bytes.old"))
    ]
    assert leftovers == []
