"""The whole system: a local swarm (`tools/swarm.py up`) against the centralized reference.

Every node is its own OS process on 127.0.0.1; the tests drive the same commands a user runs.
A 3-stage version of examples/tiny.toml with 2 workers per stage and averaging on trains on
shards made from the standard library's sources; its per-sample losses (the trainer's
--loss-log) are compared by sample id with `tools/reference_train.py` on the same samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agora_core.testing import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")
SAMPLES = 1024
LANES = "2"  # few samples in flight: steps stay close to the target batch, as in the reference


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    command = [
        sys.executable,
        str(ROOT / "tools" / "make_shards.py"),
        str(out),
        "--shards",
        "4",
        "--max-mb",
        "2",
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture
def config(tmp_path) -> Path:
    """examples/tiny.toml with three stages."""
    text = (ROOT / "examples" / "tiny.toml").read_text()
    lines = [
        "stage_layers = [1, 1, 1]" if line.startswith("stage_layers") else line for line in text.splitlines()
    ]
    path = tmp_path / "e2e.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


class Swarm:
    """`swarm.py up` in the background; always brought down, even when a test fails."""

    def __init__(self, config: Path, shards: Path, run_dir: Path, samples: int):
        self.run_dir = run_dir
        self.log = run_dir.parent / "up.log"
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
            "--run-dir",
            str(self.run_dir),
        ]

    def command(self, *args: str) -> str:
        result = subprocess.run(
            [sys.executable, SWARM, *args, "--run-dir", str(self.run_dir)],
            capture_output=True,
            text=True,
            timeout=150,
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

    def wait_done(self, timeout_s: float) -> str:
        self.proc.wait(timeout=timeout_s)
        return self.log.read_text()

    def stop(self) -> None:
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

    def start(config: Path, shards: Path, samples: int) -> Swarm:
        swarm = Swarm(config, shards, tmp_path / "run", samples)
        started.append(swarm)
        return swarm

    yield start
    for swarm in started:
        swarm.stop()


def reference_losses(config: Path, shards: Path, samples: int, out: Path) -> np.ndarray:
    script = str(ROOT / "tools" / "reference_train.py")
    flags = ["--config", str(config), "--shards", str(shards), "--samples", str(samples)]
    subprocess.run(
        [sys.executable, script, *flags, "--loss-log", str(out), "--print-every", "0"],
        check=True,
        capture_output=True,
        timeout=150,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return np.array([r["loss"] for r in sorted(records, key=lambda r: r["id"])])


def test_the_swarm_trains_like_the_centralized_reference(tmp_path, config, shards, swarm_factory):
    swarm = swarm_factory(config, shards, SAMPLES)
    output = swarm.wait_done(timeout_s=150)
    assert "trainers finished" in output, output
    losses = swarm.losses()
    assert sorted(losses) == list(range(SAMPLES))  # every sample once, none lost
    ours = np.array([losses[i] for i in range(SAMPLES)])
    theirs = reference_losses(config, shards, SAMPLES, tmp_path / "reference.jsonl")
    window = slice(SAMPLES // 2, SAMPLES)  # the second half: the same samples on both sides
    gap = ours[window].mean() / theirs[window].mean() - 1
    print(f"swarm {ours[window].mean():.4f} vs reference {theirs[window].mean():.4f}: {gap:+.2%}")
    assert abs(gap) <= 0.05
    assert ours[window].mean() < 0.75 * ours[:64].mean()  # it learned
    logs = "".join(p.read_text() for p in (swarm.run_dir / "logs").glob("worker-*.log"))
    assert "averaging_round" in logs and "averaging_success=1.0" in logs  # replicas averaged


def test_the_swarm_keeps_training_through_a_departure_and_an_arrival(config, shards, swarm_factory):
    swarm = swarm_factory(config, shards, SAMPLES)
    wait_until(lambda: len(swarm.losses()) >= 200, timeout_s=120, what="200 samples")
    assert "killed worker-1-1" in swarm.command("kill-worker", "1")
    at_kill = len(swarm.losses())
    wait_until(
        lambda: len(swarm.losses()) >= at_kill + 150, timeout_s=60, what="training on one stage-1 worker"
    )
    assert "added worker-1-2" in swarm.command("add-worker", "1")
    output = swarm.wait_done(timeout_s=150)
    assert "trainers finished" in output, output
    losses = swarm.losses()
    assert sorted(losses) == list(range(SAMPLES))  # nothing lost to the departure
    newcomer = (swarm.run_dir / "logs" / "worker-1-2.log").read_text()
    assert "applied=True" in newcomer  # the arrival trained on samples and stepped with the stage
    curve = np.array([losses[i] for i in range(SAMPLES)])
    assert curve[-128:].mean() < 0.75 * curve[:64].mean()
    assert not [p for p in _pids(swarm.run_dir) if _running(p)], "the swarm left processes behind"


def _pids(run_dir: Path) -> list[int]:
    return [m["pid"] for m in json.loads((run_dir / "swarm.json").read_text())["members"]]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
