"""Driving a local swarm (`tools/swarm.py up`) from the whole-system tests, the way a user does.

tests/conftest.py serves the fixtures built on it (``swarm_shards``, ``swarm_config``,
``swarm_factory``); the tests import the bounds and helpers below. It runs from a checkout
(``agora_localswarm.checkout``).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from agora_core.config import load_run_config
from agora_core.dht import BlockingDht
from agora_core.errors import AgoraError
from agora_core.schema import averaging_summary_key
from agora_devkit.processes import wait_until
from agora_localswarm import checkout
from agora_localswarm.processes import SwarmFile
from agora_localswarm.status import light_member
from agora_trainer.data.cursor import reading_order
from agora_trainer.data.shards import open_shard_set

ROOT = checkout.root()
SWARM = str(ROOT / "tools" / "swarm.py")

SAMPLES = 1024
LANES = "2"  # few samples in flight: steps stay close to the target batch, as in the reference
# Bounds on each wait. A test's own timeout is their sum plus a margin, so a wait that runs
# out fails with its own message, not pytest-timeout's stack dump.
RUN_S = 240  # one swarm run of SAMPLES, start to finish (every wait inside it shares this)
REFERENCE_S = 120  # tools/reference_train.py on the same samples
KILL_S = 30  # `swarm.py kill-worker`
ADD_S = 150  # `swarm.py add-worker`: the newcomer imports torch on a busy machine
MARGIN_S = 30
# What "it learned" means here: the loss per token fell this far below its start (near
# ln 512 = 6.2 for examples/tiny.toml's BPE, whose loss falls by fewer nats in a few dozen
# steps than a byte model's from ln 256).
LEARNED_NATS = 0.5


def make_swarm_shards(out: Path, *, shards: int = 4, max_mb: float = 2, validation: float = 0.05) -> Path:
    """The standard library's sources with examples/tiny.toml's tokenizer (a BPE learned from
    them), a few dozen files held out as the validation split."""
    command = [sys.executable, str(ROOT / "tools" / "make_shards.py"), str(out)]
    command += ["--config", str(ROOT / "examples" / "tiny.toml"), "--shards", str(shards)]
    command += ["--max-mb", f"{max_mb:g}", "--validation-fraction", f"{validation:g}"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return out


# Shorter sync phases than tiny.toml's, so a newcomer serves well before the run ends.
EDITS = {
    "stage_layers": "stage_layers = [1, 1, 1]",
    "weight_sync_steps": "weight_sync_steps = 10",
    "optimizer_sync_steps": "optimizer_sync_steps = 3\nstale_after_steps = 5",
    "every_steps": "every_steps = 10",  # checkpoints well before anything is killed
}


def make_swarm_config(tmp_path: Path, edits: dict[str, str] = EDITS, name: str = "e2e.toml") -> Path:
    """examples/tiny.toml with each line that starts with a key of ``edits`` replaced by its
    value (by default: three stages and shorter sync phases)."""
    text = (ROOT / "examples" / "tiny.toml").read_text()
    lines = [next((v for k, v in edits.items() if line.startswith(k)), line) for line in text.splitlines()]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


class Swarm:
    """`swarm.py up` in the background; always brought down, even when a test fails."""

    def __init__(self, config: Path, shards: Path, run_dir: Path, samples: int, export: bool):
        self.run = load_run_config(config)
        self.run_dir = run_dir
        self.log = run_dir.parent / "up.log"
        self.deadline = time.monotonic() + RUN_S  # for the whole run
        self._dht: BlockingDht | None = None
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                SWARM,
                "up",
                "--config",
                str(config),
                "--shards",
                str(shards),
                *self.flags(samples),
                "--export" if export else "--no-export",  # the model is checked where it is exported
            ],
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def flags(self, samples: int) -> list[str]:
        return [
            "--samples",
            str(samples),
            "--lanes",
            LANES,
            "--microbatch",
            "1",  # one sample a lane: few in flight (the main job's 2 are measured by efficiency.py)
            "--replicas",
            "2",
            "--no-monitor",  # tests/test_monitor_dashboard.py checks the monitor in a swarm
            "--run-dir",
            str(self.run_dir),
        ]

    def command(self, *args: str, timeout_s: float) -> str:
        result = subprocess.run(
            [sys.executable, SWARM, *args, "--run-dir", str(self.run_dir)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    def losses(self) -> dict[int, float]:
        path = self.run_dir / "trainer-0.losses.jsonl"
        if not path.exists():
            return {}
        out = {}
        for line in path.read_text().splitlines():
            if line.endswith("}"):  # the trainer may be mid-write of the last line
                record = json.loads(line)
                assert record["id"] not in out, f"sample {record['id']} completed twice"
                out[record["id"]] = record["loss"]
        return out

    def members(self) -> list[dict]:
        """What `up` started (RUN_DIR/swarm.json); empty until it has written the file."""
        path = self.run_dir / "swarm.json"
        return json.loads(path.read_text())["members"] if path.exists() else []

    def placed(self) -> list[list[str]]:
        """The names of each stage's workers, in start order, once the authorizer placed every
        worker `up` started and each serves."""
        replicas = 2 * self.run.model.n_stages

        def all_serving() -> bool:
            workers = [m for m in self.members() if m["role"] == "worker"]
            return len(workers) >= replicas and all(m["stage"] is not None and m["address"] for m in workers)

        self.while_running(all_serving, what="every worker placed and serving")
        workers = [m for m in self.members() if m["role"] == "worker"]
        return [[m["name"] for m in workers if m["stage"] == s] for s in range(self.run.model.n_stages)]

    def while_running(self, predicate: Callable[[], bool], *, what: str) -> None:
        """Wait until ``predicate`` holds; fail if the run ends or its deadline passes first."""
        held = False

        def held_or_stopped() -> bool:
            nonlocal held
            held = predicate()
            return held or self.proc.poll() is not None

        remaining_s = max(0.0, self.deadline - time.monotonic())
        wait_until(
            held_or_stopped, timeout_s=remaining_s, what=f"{what} (the run has {RUN_S} s)", every_s=0.3
        )
        if not held:
            raise AssertionError(f"the swarm stopped before {what}:\n{self.log.read_text()}")

    @property
    def dht(self) -> BlockingDht:
        """A light DHT member of the swarm, bootstrapped to its seed (started on first use)."""
        if self._dht is None:

            def seed_known() -> bool:
                path = self.run_dir / "swarm.json"
                return path.exists() and bool(json.loads(path.read_text())["seed_address"])

            self.while_running(seed_known, what="the DHT seed's address in swarm.json")
            # Kept before it starts: a join that fails is still stopped (its thread, its socket).
            self._dht = BlockingDht(run_node=light_member(SwarmFile.load(self.run_dir)))
            self._dht.start()
        return self._dht

    def averaging_reports(self, stage: int) -> list[dict]:
        """The latest averaging round each worker of ``stage`` published in the DHT."""
        with contextlib.suppress(AgoraError, TimeoutError):  # not reachable now: nothing seen
            found = self.dht.get(averaging_summary_key(self.run.name, stage))
            return [v.value for v in found.values() if isinstance(v.value, dict)]
        return []

    def worker_info(self, name: str) -> dict | None:
        """``worker.info`` of the worker ``name`` (e.g. worker-6); None if it does not answer."""
        address = next((m["address"] for m in self.members() if m["name"] == name), "")
        if not address:
            return None

        with contextlib.suppress(AgoraError, TimeoutError):  # as a member: authenticated
            return self.dht.submit(self.dht.client.call(address, "worker.info", timeout_s=5)).meta
        return None

    def wait_done(self) -> str:
        self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        return self.log.read_text()

    def stop(self) -> None:
        try:
            if self._dht is not None:
                self._dht.stop()
        finally:
            if self.proc.poll() is None:
                self.proc.terminate()  # `up` stops its nodes on the way out
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            if (self.run_dir / "swarm.json").exists():
                subprocess.run([sys.executable, SWARM, "down", "--run-dir", str(self.run_dir)], timeout=90)
            self._out.close()


def first_samples(shards: Path, run, count: int) -> list[int]:
    """The ids of the first ``count`` samples the trainer takes (shuffled by data.shuffle_seed)."""
    return reading_order(
        open_shard_set(shards, "train").shards, run.model.seq_len, run.data.shuffle_seed, count
    )


def reference_losses(
    config: Path, shards: Path, samples: int, out: Path, *, export: Path, order: list[int]
) -> np.ndarray:
    script = str(ROOT / "tools" / "reference_train.py")
    flags = ["--config", str(config), "--shards", str(shards), "--samples", str(samples)]
    subprocess.run(
        [
            sys.executable,
            script,
            *flags,
            "--loss-log",
            str(out),
            "--print-every",
            "0",
            "--export",
            str(export),
        ],
        check=True,
        capture_output=True,
        timeout=REFERENCE_S,
    )
    losses = {r["id"]: r["loss"] for r in map(json.loads, out.read_text().splitlines())}
    return np.array([losses[i] for i in order])  # the reference reads the same samples in the same order


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
