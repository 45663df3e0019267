"""make_shards' worker processes never hang it: twenty runs in a row with two workers, each
under a deadline (as a benchmark and the main job's first step run it, after a BPE was
learned in the same process), and a worker killed mid-run fails the run at once with a
ShardError, leaving no process behind."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from agora_devkit.processes import spawn_python

RUNS = 20
RUN_DEADLINE_S = 60  # one run shards well under a MB: a second or two on a loaded machine

REPEATED_RUNS = textwrap.dedent(
    f"""
    import sys, tempfile, time
    from pathlib import Path
    from agora_trainer.data.manifest import load_tokenizer
    from agora_trainer.data.sharding import TrainBpe, make_shards
    from agora_trainer.data.shards import open_shard_set
    from agora_trainer.data.tokenizer import ByteTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # learning a BPE runs the tokenizers library's thread pool in this process, which
        # the workers are then forked from
        make_shards(tmp / "learned", shards=1, tokenizer=TrainBpe(512), max_bytes=200_000, workers=1)
        bpe = load_tokenizer(tmp / "learned", open_shard_set(tmp / "learned").tokenizer)
        print("READY", flush=True)
        for run in range({RUNS}):
            tokenizer = bpe if run % 2 else ByteTokenizer()
            started = time.monotonic()
            manifest = make_shards(tmp / f"run-{{run}}", shards=2, tokenizer=tokenizer, max_bytes=400_000, workers=2)
            tokens = sum(s.tokens for s in manifest.shards)
            print(f"RUN {{run}} {{tokens}} {{time.monotonic() - started:.2f}}", flush=True)
    """
)


def test_twenty_runs_with_two_workers_each_finish_within_a_deadline():
    with spawn_python(["-c", REPEATED_RUNS]) as child:
        child.read_until("READY", timeout_s=120)
        for run in range(RUNS):
            tokens, _seconds = child.read_until(f"RUN {run} ", timeout_s=RUN_DEADLINE_S).split()
            assert int(tokens) > 100_000, f"run {run} made only {tokens} tokens"
        assert child.proc.wait(timeout=30) == 0


KILLED_WORKER = textwrap.dedent(
    """
    import multiprocessing, os, signal, tempfile
    from agora_trainer.errors import ShardError
    from agora_trainer.data.sharding import make_shards
    from agora_trainer.data.tokenizer import ByteTokenizer

    def kill_a_worker(*_):
        workers = multiprocessing.active_children()
        if workers and not killed:
            killed.append(workers[0].pid)
            os.kill(workers[0].pid, signal.SIGKILL)  # as the out-of-memory killer would

    killed = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            make_shards(tmp, shards=2, tokenizer=ByteTokenizer(), max_bytes=40_000_000, workers=2,
                        progress=kill_a_worker)
        except ShardError as e:
            print("REFUSED", killed, e, flush=True)
        else:
            print("FINISHED", killed, flush=True)
    print("LEFT", len(multiprocessing.active_children()), flush=True)
    """
)


def test_a_killed_worker_fails_the_run_at_once_instead_of_hanging_it():
    done = subprocess.run([sys.executable, "-c", KILLED_WORKER], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED [" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "worker process died" in done.stdout, done.stdout
    assert "LEFT 0" in done.stdout, done.stdout
