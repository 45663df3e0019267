"""What ``tools/swarm.py up`` prints once its swarm stopped: the exported model's held-out loss
and a sample (with a WARNING when it is far above what the trainers last saw), and the cost of
decentralization -- the swarm's samples/s against the same model trained centralized on this
machine (``reference_train.py``, a short run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
from pathlib import Path

import click

from agora_localswarm import checkout

CENTRALIZED_SAMPLES = 320  # enough for a steady rate (~3 s on two cores), past its warm-up
# The held-out text is of the same kind as the training text, so a healthy export scores near
# the trainers' last losses; this many times above them means some stage's checkpoint does not
# hold the swarm's weights (a wrecked or lagging replica), which a tiny run's overfitting never
# explains.
HELD_OUT_ALARM_RATIO = 1.5
LAST_SAMPLES = 64  # the trainers' last completed samples the held-out loss is held against


def export_and_evaluate(run_dir: Path, config: str, shards: Path) -> None:
    """The trained model from the workers' final checkpoints, its held-out loss and a sample."""
    model = run_dir / "model.safetensors"
    click.echo("what did the swarm learn? exporting the model from the workers' final checkpoints ...")
    if subprocess.run(export_command(run_dir, config, shards, model)).returncode != 0:
        click.echo("no model exported (see the error above)")
        return
    evaluate = checkout.tool("evaluate.py", str(model), "--shards", str(shards))
    held_out = _held_out_loss([*evaluate, "--samples", "256", "--tokens", "160", "--json"])
    training = last_training_loss(run_dir)
    if held_out is not None and training is not None and held_out > HELD_OUT_ALARM_RATIO * training:
        click.echo(
            f"WARNING: the exported model's held-out loss, {held_out:.3f} nats/token, is "
            f"{held_out / training:.1f}x the mean loss of the trainers' last {LAST_SAMPLES} samples, "
            f"{training:.3f} (alarm above {HELD_OUT_ALARM_RATIO:g}x): a stage's checkpoint likely does "
            "not hold the swarm's weights. Read the export's per-stage lines above, then export from "
            f"worker directories you trust: tools/export_model.py --from-checkpoints "
            f"{run_dir / 'checkpoints'}/<worker> (repeat it, one or more per stage) --out ... "
            "(or from live workers, --bootstrap, while a run is up)"
        )


def export_command(run_dir: Path, config: str, shards: Path, model: Path) -> list[str]:
    """The command line that exports the swarm's model to ``model`` from the final
    checkpoints its workers left in ``run_dir``."""
    export = checkout.tool("export_model.py", "--config", config, "--out", str(model))
    export += ["--shards", str(shards)]  # the model records the shards' tokenizer
    return [*export, "--from-checkpoints", str(run_dir / "checkpoints")]


def last_training_loss(run_dir: Path, samples: int = LAST_SAMPLES) -> float | None:
    """The mean loss of the last ``samples`` samples the trainers completed (all trainers' loss
    logs, by time), None without any."""
    records = []
    for path in sorted(run_dir.glob("trainer-*.losses.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):  # a line cut short by a kill
                record = json.loads(line)
                records.append((float(record["t"]), float(record["loss"])))
    last = [loss for _, loss in sorted(records)[-samples:]]
    return sum(last) / len(last) if last else None


def _held_out_loss(evaluate: list[str]) -> float | None:
    """Run ``evaluate.py ... --json``, passing its lines through but its closing JSON object;
    the held-out loss from that (None if it failed)."""
    result: dict = {}
    unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}  # its progress lines as they come
    with subprocess.Popen(evaluate, stdout=subprocess.PIPE, text=True, env=unbuffered) as process:
        for line in process.stdout or ():
            if line.startswith("{"):  # its last line; the sample's lines start with "  | "
                with contextlib.suppress(ValueError):
                    result = json.loads(line)
                    continue
            click.echo(line, nl=False)
    loss = result.get("held_out_loss") if process.returncode == 0 else None
    return float(loss) if isinstance(loss, int | float) else None


def centralized_rate(
    config: str, shards: Path, samples: int = CENTRALIZED_SAMPLES, *, loss_log: Path | None = None
) -> float | None:
    """Samples/s of ``reference_train.py`` on this machine over the first ``samples`` samples,
    its per-sample losses in ``loss_log`` if given (None where it cannot run: e.g. a surrogate
    model, or fewer samples in the shards)."""
    command = checkout.tool("reference_train.py", "--config", config)
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
