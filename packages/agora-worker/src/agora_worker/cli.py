"""``agora-worker``: contribute a GPU (or CPU) to an Agora run by serving one pipeline stage."""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from agora_core.config import NodeSettings
from agora_core.contract import Phase
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.logs import get_logger
from agora_core.metrics import NodeMetrics
from agora_core.node_cli import (
    fail,
    launch_role,
    node_options,
)
from agora_worker import __version__
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora-worker")
def main() -> None:
    """Serve one pipeline stage of an Agora run."""


async def _run(worker: Worker, settings: NodeSettings) -> int:
    """Serve until SIGINT/SIGTERM or a self-termination rule trips; the exit code (0: a clean
    stop, else the tripped rule's, agora_worker.termination.EXIT_CODES)."""
    log = get_logger("worker.cli")
    endpoint = worker.metrics.serve_http(settings.metrics_port) if settings.metrics_port is not None else None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    address = await worker.start()
    click.echo(f"agora-worker {__version__}: stage {worker.stage} ({worker.role}) of run {worker.run.name!r}")
    click.echo(f"  node id    {worker.key.node_id}")
    click.echo(f"  serving    {address}")
    click.echo(f"  device     {worker.device}, microbatches up to {worker.max_batch} samples")
    joined = worker.joined
    source = {"peers": "downloaded from live replicas", "checkpoint": "resumed from a checkpoint"}
    click.echo(f"  state      step {joined.step}, {source.get(joined.source, 'initial weights')}")
    click.echo(f"  phase      {worker.phases.phase}")
    if endpoint is not None:
        click.echo(f"  metrics    http://127.0.0.1:{endpoint.port}/metrics")
    writer = worker.checkpoint_writer
    if writer is not None:
        every, keep = worker.run.checkpoint.every_steps, worker.run.checkpoint.keep
        click.echo(f"  checkpoint {writer.store.directory} (every {every} steps, keep {keep})")
        if worker.settings.resume:
            step = writer.resumed_step
            click.echo(f"  resumed    {'none valid: started fresh' if step is None else f'step {step}'}")
    sys.stdout.flush()
    waits = [loop.create_task(stop.wait()), loop.create_task(worker.watchdog.wait())]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        verdict = worker.watchdog.verdict
        if verdict is None:
            log.info("shutting_down", grace_s=worker.settings.shutdown_grace_s)
        else:  # it already withdrew and published why; leaving and stopping remain
            click.echo(f"terminated: {verdict.reason} (exit code {verdict.exit_code}): {verdict.detail}")
            sys.stdout.flush()
    finally:
        for task in waits:
            task.cancel()
        await worker.stop()
        if endpoint is not None:
            endpoint.close()
        if settings.metrics_push_gateway:
            worker.metrics.push(settings.metrics_push_gateway)
        click.echo("stopped")
    return worker.watchdog.exit_code


@main.command()
@click.option(
    "--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Run config TOML."
)
@click.option("--stage", required=True, type=int, help="Pipeline stage to serve (0 = head).")
@node_options
@click.option("--device", help="auto (default: CUDA when present), cpu, cuda or cuda:N.")
@click.option("--max-batch", "max_batch_samples", type=int, help="Most samples merged into one microbatch.")
@click.option("--max-batch-tokens", type=int, help="Most tokens in one microbatch.")
@click.option(
    "--progress-interval", "progress_interval_s", type=float, help="Seconds between stage-progress checks."
)
@click.option("--announce-interval", "announce_interval_s", type=float, help="Seconds between announcements.")
@click.option(
    "--download",
    type=click.Choice(["auto", "always", "never"]),
    help="Download the stage's state from live replicas: auto (default: when they are more than "
    "sync.stale_after_steps ahead), always, never.",
)
@click.option(
    "--phase",
    type=click.Choice([phase.value for phase in Phase if phase is not Phase.DOWNLOADING]),
    help="Operators and tests: pin one phase for good (default: the sync phases run by themselves).",
)
@click.option(
    "--surrogate-delay-scale",
    "surrogate_delay_scale",
    type=float,
    help="Surrogate stages only: multiply the injected delays (a slower node).",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False),
    help="Write checkpoints here (every [checkpoint] every_steps steps, and on a clean stop).",
)
@click.option(
    "--resume",
    is_flag=True,
    default=None,
    help="Start from the newest valid checkpoint in --checkpoint-dir (fresh if there is none).",
)
def run(config_file, stage, bootstrap, **options) -> None:
    """Serve STAGE of the run in --config until SIGINT/SIGTERM (in-flight requests finish) or
    until a [termination] rule trips (the exit code then names the rule)."""
    node, run_config, settings = launch_role("worker", options, config_file, WorkerSettings)
    try:
        key = NodeKey.load_or_create(node.key_file)
        worker = Worker(
            run=run_config,
            stage=stage,
            key=key,
            listen=node.listen,
            bootstrap=list(bootstrap),
            advertise=node.advertise,
            settings=settings,
            metrics=NodeMetrics(role="worker", stage=stage, instance=key.node_id[:12]),
            link=node.link_emulator(),
        )
        code = asyncio.run(_run(worker, node))
    except (AgoraError, OSError, ValueError) as exc:
        fail(str(exc), code=1)
    sys.exit(code)
