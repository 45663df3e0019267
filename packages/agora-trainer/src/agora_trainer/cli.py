"""``agora-trainer``: drive samples from data shards through an Agora swarm's pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import click

from agora_core.admission.node_admission import CREDENTIAL_LOST_EXIT_CODE, NodeAdmission, cpu_hardware
from agora_core.config import NodeSettings
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.heap import settle_startup_heap
from agora_core.node.options import (
    fail,
    launch_role,
    node_options,
    status_interval_option,
)
from agora_core.node.role import RoleNode
from agora_core.observability.metrics_exposure import MetricsExposure
from agora_trainer import __version__
from agora_trainer.data import shards_cli
from agora_trainer.data.rotation_cli import rotate_shards
from agora_trainer.trainer import Trainer, TrainerSettings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora-trainer")
def main() -> None:
    """Train an Agora run's model by routing samples through its workers (no GPU needed)."""


main.add_command(rotate_shards)


@main.command(
    "make-shards",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.pass_context
def make_shards_command(ctx: click.Context) -> None:
    """Turn a corpus into a shard set: a manifest, training shards, a validation split (--help)."""
    sys.exit(shards_cli.main(ctx.args or ["--help"]))


def status_line(trainer: Trainer) -> str:
    s = trainer.status()
    loss = "-" if s["loss"] is None else f"{s['loss']:.3f} (ema {s['loss_ema']:.3f})"
    return (
        f"samples {s['completed']} ({s['samples_per_s']:.2f}/s, {s['tokens_per_s']:.0f} tok/s)  loss {loss}  "
        f"in flight {s['in_flight']}  workers/stage {s['workers']}  retries {s['retries']}  bans {s['bans']}  "
        f"spot checks {s['spot_checks']} ({s['spot_mismatches']} failed)"
    )


def _echo(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()


async def _run(trainer: Trainer, node: NodeSettings, status_interval_s: float) -> int:
    """Admit (an authorized run), train, close; the exit code (0, or CREDENTIAL_LOST_EXIT_CODE
    when the credential was lost: the trainer stops at once, its samples in flight abandoned
    to a later run)."""
    loop = asyncio.get_running_loop()
    exposure = MetricsExposure.start(trainer.metrics, node, run=trainer.run.name)
    clean = False  # only a finished or stopped run deletes the trainer's gateway group
    stops = 0
    starting = loop.create_task(_start(trainer))
    training: asyncio.Task | None = None
    lost: list[tuple[str, str]] = []

    def on_lost(reason: str, detail: str) -> None:
        lost.append((reason, detail))
        (starting if training is None else training).cancel()

    def on_signal() -> None:
        nonlocal stops
        stops += 1
        if training is None:  # still queued or waiting for workers: nothing in flight
            starting.cancel()
        elif stops == 1:
            click.echo("stopping: lanes finish their samples (Ctrl-C again to abandon them)")
            trainer.request_stop()
        else:
            training.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    lanes = f"{len(trainer.lanes)} lanes x {trainer.settings.microbatch} samples"
    click.echo(f"agora-trainer {__version__}: run {trainer.run.name!r}, {lanes}")
    click.echo(f"  node id    {trainer.key.node_id}")
    _echo(f"  shards     {trainer.cursor.total} samples, {trainer.cursor.done} done before")
    for line in exposure.describe():
        _echo(line)
    if isinstance(trainer.admission, NodeAdmission):
        trainer.admission.on_lost.append(on_lost)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        if starting.cancelled() and not lost:
            click.echo("stopped before training")
            clean = True
            return 0
        if not lost:
            training = loop.create_task(trainer.train())
            await _follow(trainer, training, status_interval_s)
        if lost:
            reason, detail = lost[0]
            _echo(
                f"credential lost ({reason}): {detail}; stopped after {trainer.counters.completed} samples "
                f"(exit code {CREDENTIAL_LOST_EXIT_CODE})"
            )
            return CREDENTIAL_LOST_EXIT_CODE
        click.echo(
            f"done: {trainer.counters.completed} samples this run, {trainer.cursor.done} of {trainer.cursor.total} overall"
        )
        clean = True
    finally:
        await trainer.close()
        exposure.close(clean=clean)
    return 0


async def _start(trainer: Trainer) -> None:
    """Ask the authorizer (an authorized run), join, wait until admitted and every stage has a
    worker."""
    admission = trainer.admission
    if isinstance(admission, NodeAdmission):
        _echo(f"  authorizer {admission.authorizer} (account {admission.settings.account or '-'})")
        await admission.submit()
    await trainer.start()
    credential = admission.info()
    if credential is not None:
        _echo(f"  credential {credential['serial']}, valid {credential['expires_in_s']:.0f} s")


async def _follow(trainer: Trainer, training: asyncio.Task, status_interval_s: float) -> None:
    """A status line every ``status_interval_s`` until ``training`` ends (or is cancelled)."""
    click.echo(f"  workers    {[len(b.workers) for b in trainer.balancers]} per stage; training")
    settle_startup_heap()
    while not training.done():
        await asyncio.wait([training], timeout=status_interval_s)
        click.echo(status_line(trainer))
    with contextlib.suppress(asyncio.CancelledError):
        await training


@main.command()
@click.option(
    "--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Run config TOML."
)
@click.option(
    "--shards", "shards_dir", required=True, type=click.Path(file_okay=False), help="Folder of data shards."
)
@node_options
@click.option("--lanes", type=int, help="Microbatches in flight at once (default 8).")
@click.option(
    "--microbatch",
    type=int,
    help="Samples a lane sends through the pipeline together, one request per hop (default 1).",
)
@click.option("--max-samples", type=int, help="Stop after completing this many samples.")
@click.option(
    "--state-file", help="Where the position in the shards is kept (default: in the shards folder)."
)
@click.option(
    "--shard-ranges",
    help="The shard ids this trainer reads, e.g. 0-3,8 (default: all), until the operator assigns "
    "others (tools/rotate_shards.py).",
)
@click.option("--epochs", type=int, help="Passes over its shards, each in a new shuffled order (default 1).")
@click.option(
    "--backward-routing",
    type=click.Choice(["pinned", "random"]),
    help="pinned (default): a backward goes to the worker that ran its forward; random: ablation only.",
)
@click.option("--loss-log", help="Append one JSON line per completed sample (id, loss, time) to this file.")
@click.option(
    "--spot-check-fraction",
    type=float,
    help="Of the microbatches, the fraction whose output at each stage is recomputed on another "
    "replica to catch a worker that computes wrongly (default 0.05; 0: none).",
)
@click.option(
    "--refresh-interval", "refresh_interval_s", type=float, help="Seconds between worker-list refreshes."
)
@click.option(
    "--progress-interval", "progress_interval_s", type=float, help="Seconds between progress reports."
)
@status_interval_option()
def run(config_file, shards_dir, bootstrap, status_interval_s, **options) -> None:
    """Train on the samples in --shards until they run out, --max-samples, or Ctrl-C."""
    node, run_config, settings = launch_role("trainer", options, config_file, TrainerSettings)
    try:
        key = NodeKey.load_or_create(node.key_file)
        member = RoleNode.from_settings("trainer", run_config, key, node, list(bootstrap))
        if run_config.admission.authorized:  # the challenge on the CPU, with numpy
            member.ask_authorizer(
                node, cpu_hardware(), on_status=lambda status: _echo(f"  admission  {status.describe()}")
            )
        trainer = Trainer(run=run_config, shards_dir=shards_dir, key=key, settings=settings, member=member)
        code = asyncio.run(_run(trainer, node, status_interval_s))
    except (AgoraError, OSError, ValueError) as exc:  # DataError is an AgoraError
        fail(str(exc), code=1)
    sys.exit(code)
