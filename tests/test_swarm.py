"""The whole system: a local swarm (`tools/swarm.py up`) against the centralized reference.

Every node is its own OS process on 127.0.0.1; the tests drive the same commands a user runs.
The swarm is authorized, as a public run is: an authorizer process admits every node and
places the workers (two per stage), and pins a worker that is added or restarted to its stage.
A 3-stage version of examples/tiny.toml with 2 workers per stage and averaging on trains on
shards made from the standard library's sources with its BPE tokenizer (learned from them);
its per-sample losses (the trainer's --loss-log) are compared by sample id with
`tools/reference_train.py` on the same samples.
What the nodes did is read while they run, the way an operator's tools read it: averaging
reports from the DHT (a light DHT member of the swarm), a worker's state over its RPC.
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
import pytest

from agora_core.config import load_run_config
from agora_core.dht import BlockingDht
from agora_core.errors import AgoraError
from agora_core.schema import averaging_summary_key
from agora_core.testing import wait_until
from agora_trainer.cursor import reading_order
from agora_trainer.held_out import validation_samples
from agora_trainer.shards import open_shard_set
from agora_worker.checkpoint import CheckpointStore, find_manifests
from agora_worker.model.export import read_model
from agora_worker.model.inference import WholeModel, held_out_loss

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")
sys.path.insert(0, str(ROOT / "tools"))
from swarm_processes import SwarmFile  # noqa: E402 (tools/ is not a package: its modules import as scripts do)
from swarm_status import light_member  # noqa: E402

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


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """The standard library's sources with examples/tiny.toml's tokenizer (a BPE learned from
    them), a few dozen files held out as the validation split."""
    out = tmp_path_factory.mktemp("shards")
    command = [sys.executable, str(ROOT / "tools" / "make_shards.py"), str(out)]
    command += ["--config", str(ROOT / "examples" / "tiny.toml"), "--shards", "4", "--max-mb", "2"]
    command += ["--validation-fraction", "0.05"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return out


# Shorter sync phases than tiny.toml's, so a newcomer serves well before the run ends.
EDITS = {
    "stage_layers": "stage_layers = [1, 1, 1]",
    "weight_sync_steps": "weight_sync_steps = 10",
    "optimizer_sync_steps": "optimizer_sync_steps = 3\nstale_after_steps = 5",
    "every_steps": "every_steps = 10",  # checkpoints well before anything is killed
}


@pytest.fixture
def config(tmp_path) -> Path:
    """examples/tiny.toml with three stages and shorter sync phases."""
    text = (ROOT / "examples" / "tiny.toml").read_text()
    lines = [next((v for k, v in EDITS.items() if line.startswith(k)), line) for line in text.splitlines()]
    path = tmp_path / "e2e.toml"
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


@pytest.fixture
def swarm_factory(tmp_path):
    started: list[Swarm] = []

    def start(config: Path, shards: Path, samples: int, *, export: bool = False) -> Swarm:
        swarm = Swarm(config, shards, tmp_path / "run", samples, export)
        started.append(swarm)
        return swarm

    yield start
    for swarm in started:
        swarm.stop()


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


@pytest.mark.timeout(RUN_S + REFERENCE_S + MARGIN_S, func_only=True)
def test_the_swarm_trains_like_the_centralized_reference(tmp_path, config, shards, swarm_factory):
    swarm = swarm_factory(config, shards, SAMPLES, export=True)
    stages = range(swarm.run.model.n_stages)
    assert [len(names) for names in swarm.placed()] == [2] * len(stages)  # the authorizer spread them
    averaged: set[int] = set()

    def every_stage_averaged() -> bool:  # replicas (2 in a group) averaged their whole segment
        for stage in stages:
            for report in swarm.averaging_reports(stage):
                if report.get("group_size", 0) >= 2 and report.get("averaging_success") == 1.0:
                    averaged.add(stage)
        return averaged == set(stages)

    swarm.while_running(every_stage_averaged, what="a complete averaging round in every stage")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    losses = swarm.losses()
    order = first_samples(shards, swarm.run, SAMPLES)
    assert sorted(losses) == sorted(order), output  # every sample once, none lost
    ours = np.array([losses[i] for i in order])
    reference = tmp_path / "reference.safetensors"
    theirs = reference_losses(
        config, shards, SAMPLES, tmp_path / "reference.jsonl", export=reference, order=order
    )
    window = slice(SAMPLES // 2, SAMPLES)  # the second half: the same samples on both sides
    gap = ours[window].mean() / theirs[window].mean() - 1
    print(f"swarm {ours[window].mean():.4f} vs reference {theirs[window].mean():.4f}: {gap:+.2%}")
    # Measured: +2.5 % while samples came in shard order (runs of one file's code: hard for
    # both sides), +6.1 % and +6.6 % shuffled by data.shuffle_seed, where the reference learns
    # faster from varied samples than two sparsely averaged replicas per stage do in 1024
    # samples (issue 19 measures the loss ratio over longer runs: benchmarks/efficiency.py).
    assert abs(gap) <= 0.08
    assert ours[window].mean() < ours[:64].mean() - LEARNED_NATS  # it learned
    # The model came out (exported from the workers' last checkpoints) and scores on the
    # validation split, which no trainer had, about as well as the centralized reference's.
    assert "held-out loss:" in output and "bits/byte" in output, output
    exported = read_model(swarm.run_dir / "model.safetensors")
    assert exported.source == "checkpoints" and min(exported.steps) >= SAMPLES // 16 * 3 // 4, exported.steps
    samples = validation_samples(open_shard_set(shards, "validation"), swarm.run.model.seq_len, 64)
    swarm_loss, reference_loss = (
        held_out_loss(WholeModel(read_model(path).modules(), seq_len=swarm.run.model.seq_len), samples)
        for path in (swarm.run_dir / "model.safetensors", reference)
    )
    print(f"held-out loss: swarm {swarm_loss:.4f}, reference {reference_loss:.4f}")
    assert abs(swarm_loss / reference_loss - 1) <= 0.05


@pytest.mark.timeout(RUN_S + KILL_S + ADD_S + MARGIN_S, func_only=True)
def test_the_swarm_keeps_training_through_a_departure_and_an_arrival(config, shards, swarm_factory):
    swarm = swarm_factory(config, shards, SAMPLES)
    stage_1 = swarm.placed()[1]
    status = swarm.command("status", timeout_s=KILL_S)
    assert "  authorizer tcp://127.0.0.1:" in status, status
    assert "(workers per stage 0: 2, 1: 2, 2: 2)" in status, status  # the authorizer's own count
    # Early departure and arrival: the newcomer's download, weight sync and optimizer sync must
    # all fit in the run's samples however fast this machine runs them (a quiet one did 1024
    # samples before a newcomer that arrived after 350 finished its sync).
    swarm.while_running(lambda: len(swarm.losses()) >= 120, what="120 samples")
    assert f"killed {stage_1[-1]} (stage 1" in swarm.command("kill-worker", "1", timeout_s=KILL_S)
    at_kill = len(swarm.losses())
    swarm.while_running(lambda: len(swarm.losses()) >= at_kill + 80, what="training on one stage-1 worker")
    added = swarm.command("add-worker", "1", timeout_s=ADD_S)  # pinned to stage 1 by the authorizer
    newcomer = f"worker-{2 * swarm.run.model.n_stages}"
    assert f"added {newcomer} on stage 1" in added, added
    # The arrival downloads the stage's state (it is more than stale_after_steps behind), is
    # invisible to the trainer through weight sync, then trains on samples and steps with the
    # stage: once it has run backwards, a later step of its own applies a gradient.
    trained_at: list[int] = []
    phases: list[str] = []
    visible_at: list[int] = []  # samples completed when it first became visible

    def newcomer_stepped_with_samples() -> bool:
        info = swarm.worker_info(newcomer)
        if info is None:
            return False
        assert info["stage"] == 1 and info["credential"]["valid"], info
        if not phases or phases[-1] != info["phase"]:
            phases.append(info["phase"])
        if not visible_at and info["phase"] in ("optimizer_sync", "serving"):
            visible_at.append(len(swarm.losses()))
        if info["phase"] == "weight_sync":
            assert sum(info["processed_by_op"].values()) == 0, "it served batches in weight sync"
        if not trained_at and info["processed_by_op"].get("backward", 0) > 0:
            trained_at.append(info["step"])
        last = info["last_step"]
        done = bool(trained_at) and last is not None and last["applied"] and last["step"] > trained_at[0]
        if done:
            joined = info["join"]  # its installed state read back equalled the donors' bytes
            assert joined["source"] == "peers" and joined["donors"] and joined["verified"], joined
            assert info["refused_while_invisible"] == 0, "a trainer routed to it while it was invisible"
        return done

    swarm.while_running(newcomer_stepped_with_samples, what="the newcomer to step with samples it trained")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    losses = swarm.losses()
    order = first_samples(shards, swarm.run, SAMPLES)
    assert sorted(losses) == sorted(order), output  # nothing lost to the departure
    curve = np.array([losses[i] for i in order])
    assert curve[-128:].mean() < curve[:64].mean() - LEARNED_NATS  # it kept learning
    assert phases[0] in ("downloading", "weight_sync") and "weight_sync" in phases, phases
    # No spike when it joins: the samples after it became visible fare no worse than those before.
    at = visible_at[0]
    before, after = curve[max(0, at - 64) : at].mean(), curve[at : at + 64].mean()
    assert after < 1.1 * before, f"loss {before:.3f} before it joined, {after:.3f} after"
    assert not [m["pid"] for m in swarm.members() if _running(m["pid"])], "the swarm left processes behind"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(RUN_S + 2 * KILL_S + ADD_S + MARGIN_S, func_only=True)
def test_a_stage_whose_every_replica_died_resumes_from_a_checkpoint(config, shards, swarm_factory):
    samples = SAMPLES // 2  # the outage comes at about a third of them; the rest is for the comeback
    swarm = swarm_factory(config, shards, samples)
    first, last = swarm.placed()[1]  # kill-worker takes the last started first
    directory = swarm.run_dir / "checkpoints" / last

    def checkpointed() -> int:
        return max((m.step for m in find_manifests(directory)), default=0) if directory.exists() else 0

    swarm.while_running(lambda: checkpointed() >= 10, what="a checkpoint of stage 1 at step 10 or later")
    for victim in (last, first):  # every replica of stage 1
        assert f"killed {victim}" in swarm.command("kill-worker", "1", timeout_s=KILL_S)
    saved = CheckpointStore(directory, run=swarm.run, stage=1, keep=swarm.run.checkpoint.keep).newest_valid()
    assert saved is not None and saved.step >= 10

    # The dead replicas' progress reports, ahead of the checkpoint, outlive them in the DHT for
    # their TTL; the restarted worker counts only live members' reports, so it does not step
    # to catch up with them.
    output = swarm.command("restart-worker", last, timeout_s=ADD_S)  # pinned back to stage 1
    assert f"resumed from step {saved.step}" in output, output
    info = swarm.worker_info(last)
    assert info is not None and info["checkpoint"]["resumed_step"] == saved.step
    assert info["join"]["source"] == "checkpoint" and saved.step <= info["step"] < saved.step + 5, info

    def stepped_on_from_the_checkpoint() -> bool:
        info = swarm.worker_info(last)
        step = None if info is None else info["last_step"]
        return step is not None and step["applied"] and step["step"] > saved.step

    swarm.while_running(stepped_on_from_the_checkpoint, what="the resumed worker to train on")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    expected = sorted(first_samples(shards, swarm.run, samples))
    assert sorted(swarm.losses()) == expected, output  # the stage's outage lost no sample
