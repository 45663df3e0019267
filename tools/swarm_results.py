"""What ``tools/swarm.py up`` prints once its swarm stopped: the exported model's held-out loss
and a sample, and the cost of decentralization -- the swarm's samples/s against the same model
trained centralized on this machine (``reference_train.py``, a short run).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
CENTRALIZED_SAMPLES = 320  # enough for a steady rate (~3 s on two cores), past its warm-up


def export_and_evaluate(run_dir: Path, config: str, shards: Path) -> None:
    """The trained model from the workers' final checkpoints, its held-out loss and a sample."""
    model = run_dir / "model.safetensors"
    click.echo("what did the swarm learn? exporting the model from the workers' final checkpoints ...")
    export = [sys.executable, str(TOOLS / "export_model.py"), "--config", config, "--out", str(model)]
    export += ["--shards", str(shards)]  # the model records the shards' tokenizer
    if subprocess.run([*export, "--from-checkpoints", str(run_dir / "checkpoints")]).returncode != 0:
        click.echo("no model exported (see the error above)")
        return
    evaluate = [sys.executable, str(TOOLS / "evaluate.py"), str(model), "--shards", str(shards)]
    subprocess.run([*evaluate, "--samples", "256", "--tokens", "160"])


def centralized_rate(
    config: str, shards: Path, samples: int = CENTRALIZED_SAMPLES, *, loss_log: Path | None = None
) -> float | None:
    """Samples/s of ``reference_train.py`` on this machine over the first ``samples`` samples,
    its per-sample losses in ``loss_log`` if given (None where it cannot run: e.g. a surrogate
    model, or fewer samples in the shards)."""
    command = [sys.executable, str(TOOLS / "reference_train.py"), "--config", config]
    command += ["--shards", str(shards), "--samples", str(samples), "--print-every", str(samples)]
    if loss_log is not None:
        command += ["--loss-log", str(loss_log)]
    done = subprocess.run(command, capture_output=True, text=True)
    rates = re.findall(r"\(([\d.]+) samples/s\)", done.stdout)  # its status line's rate, since the start
    return float(rates[-1]) if done.returncode == 0 and rates else None


def report_efficiency(swarm_rate: float | None, config: str, shards: Path) -> None:
    """The line that puts the swarm's throughput next to the centralized one's."""
    if swarm_rate is None:
        return
    click.echo(
        f"the same model centralized on this machine (reference_train.py, {CENTRALIZED_SAMPLES} samples) ..."
    )
    rate = centralized_rate(config, shards)
    if rate is None:
        click.echo("  centralized rate not measured (reference_train.py could not run this config)")
        return
    click.echo(
        f"cost of decentralization: swarm {swarm_rate:.1f} samples/s vs centralized {rate:.1f} samples/s "
        f"({swarm_rate / rate:.2f}x; benchmarks/efficiency.py measures it over equal samples)"
    )
