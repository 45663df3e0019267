"""``agora-worker``: contribute a GPU (or CPU) to an Agora run by serving one pipeline stage."""

from __future__ import annotations

import asyncio
import signal
import sys

import click

from agora_core.admission.join_client import JoinStatus
from agora_core.config import NodeSettings, RunConfig
from agora_core.contract import Phase, StageRole
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.heap import settle_startup_heap
from agora_core.node.options import (
    fail,
    launch_role,
    node_options,
)
from agora_core.node.role import RoleNode
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics_exposure import MetricsExposure
from agora_worker import __version__
from agora_worker.admission import admit, worker_admission
from agora_worker.serving.backend import pick_device
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora-worker")
def main() -> None:
    """Serve one pipeline stage of an Agora run."""


def _echo(line: str) -> None:
    click.echo(line)
    sys.stdout.flush()  # tools read these lines from a pipe or a log file as they come


def _on_status(status: JoinStatus) -> None:
    _echo(f"  admission  {status.describe()}")


async def _main(
    run: RunConfig,
    stage: int | None,
    key: NodeKey,
    node: NodeSettings,
    settings: WorkerSettings,
    bootstrap: list[str],
) -> int:
    """Admit (an authorized run), build the worker on its stage, serve until stopped; the exit
    code (0: a clean stop, else the tripped rule's, agora_worker.termination.EXIT_CODES)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    member = RoleNode.from_settings("worker", run, key, node, bootstrap, stage=stage)
    _echo(f"agora-worker {__version__}: run {run.name!r}")
    _echo(f"  node id    {key.node_id}")
    if run.admission.authorized:
        admission = worker_admission(member, node, pick_device(settings.device), on_status=_on_status)
        _echo(f"  authorizer {node.authorizer} (account {node.account or '-'})")
        try:
            stage = await admit(admission, stop)
        except BaseException:
            admission.close()
            await member.node.stop()
            raise
        if stage is None:  # stopped while queued
            admission.close()
            await member.node.stop()
            _echo("stopped")
            return 0
        member.metrics.set_stage(stage)
    assert stage is not None  # given in an open run (the command checked), placed otherwise
    _echo(f"  stage      {stage} ({StageRole.of(stage, run.model.n_stages)})")
    worker = Worker(run=run, stage=stage, key=key, settings=settings, member=member)
    return await _serve(worker, node, stop)


async def _serve(worker: Worker, settings: NodeSettings, stop: asyncio.Event) -> int:
    """Start (join, download, wait for admission), serve until ``stop`` is set or a
    self-termination rule trips, then stop; the exit code. Metrics are served and pushed
    meanwhile (``settings``); a clean stop deletes the worker's gateway group, a
    self-termination leaves its last push there (``agora_worker_terminated`` says why)."""
    log = get_logger("worker.cli")
    exposure = MetricsExposure.start(worker.metrics, settings, run=worker.run.name)
    loop = asyncio.get_running_loop()
    starting = loop.create_task(worker.start())
    stopping = loop.create_task(stop.wait())
    waits = [stopping, loop.create_task(worker.watchdog.wait())]
    clean = False  # an error on the way leaves the group too
    try:
        await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # stopped while queued or downloading
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            clean = True
            return 0
        address = starting.result()  # AdmissionRefused, or a failed join, ends here
        _print_started(worker, address, exposure)
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        verdict = worker.watchdog.verdict
        if verdict is None:
            log.info("shutting_down", grace_s=worker.settings.shutdown_grace_s)
        else:  # it already withdrew and published why; leaving and stopping remain
            _echo(f"terminated: {verdict.reason} (exit code {verdict.exit_code}): {verdict.detail}")
        clean = verdict is None
    finally:
        for task in waits:
            task.cancel()
        await worker.stop()
        exposure.close(clean=clean)
        click.echo("stopped")
    return worker.watchdog.exit_code


def _print_started(worker: Worker, address: str, exposure: MetricsExposure) -> None:
    click.echo(f"  serving    {address}")
    settle_startup_heap()
    click.echo(f"  device     {worker.device}, microbatches up to {worker.max_batch} samples")
    joined = worker.joined
    source = {"peers": "downloaded from live replicas", "checkpoint": "resumed from a checkpoint"}
    click.echo(f"  state      step {joined.step}, {source.get(joined.source, 'initial weights')}")
    click.echo(f"  phase      {worker.phases.phase}")
    credential = worker.admission.info()
    if credential is not None:
        left = credential["expires_in_s"]
        click.echo(
            f"  credential {credential['serial']}, valid {left:.0f} s, refreshed at two thirds of its life"
        )
    for line in exposure.describe():
        click.echo(line)
    writer = worker.checkpoint_writer
    if writer is not None:
        every, keep = worker.run.checkpoint.every_steps, worker.run.checkpoint.keep
        click.echo(f"  checkpoint {writer.store.directory} (every {every} steps, keep {keep})")
        if worker.settings.resume:
            step = writer.resumed_step
            click.echo(f"  resumed    {'none valid: started fresh' if step is None else f'step {step}'}")
    sys.stdout.flush()


@main.command()
@click.option(
    "--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Run config TOML."
)
@click.option(
    "--stage",
    type=int,
    help="Pipeline stage to serve (0 = head), in an open run. An authorized run's authorizer places "
    "each worker (operators pin one with `agora-authorizer pin NODE_ID STAGE`).",
)
@node_options
@click.option("--device", help="auto (default: CUDA when present), cpu, cuda or cuda:N.")
@click.option("--max-batch", "max_batch_samples", type=int, help="Most samples merged into one microbatch.")
@click.option("--max-batch-tokens", type=int, help="Most tokens in one microbatch.")
@click.option(
    "--compute-weights",
    type=click.Choice(["fp32", "bf16"]),
    help="The device's copy of the trained weights (default fp32; bf16 halves their device memory). "
    "Masters and AdamW stay fp32 on the host. CUDA only.",
)
@click.option(
    "--progress-interval",
    "progress_interval_s",
    type=float,
    help="Seconds between stage-progress checks (counts go to the collector as they change).",
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
    """Serve a stage of the run in --config until SIGINT/SIGTERM (in-flight requests finish) or
    until a [termination] rule trips (the exit code then names the rule). An open run's worker
    serves --stage; an authorized run's (--authorizer) is placed by the authorizer."""
    node, run_config, settings = launch_role("worker", options, config_file, WorkerSettings)
    if run_config.admission.authorized and stage is not None:
        fail(
            f"--stage {stage}: in an authorized run the authorizer places each worker on a stage; "
            "leave --stage out (an operator pins a node to a stage with "
            "`agora-authorizer pin NODE_ID STAGE --db URL`)"
        )
    if not run_config.admission.authorized and stage is None:
        fail(
            '--stage is required: the run config\'s [admission] mode is "open", so nobody places this worker'
        )
    if stage is not None and not 0 <= stage < run_config.model.n_stages:
        fail(f"--stage {stage} does not exist: the run has stages 0..{run_config.model.n_stages - 1}")
    try:
        key = NodeKey.load_or_create(node.key_file)
        code = asyncio.run(_main(run_config, stage, key, node, settings, list(bootstrap)))
    except (AgoraError, OSError, ValueError) as exc:
        fail(str(exc), code=1)
    sys.exit(code)
