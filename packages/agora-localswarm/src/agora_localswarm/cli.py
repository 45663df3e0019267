"""A whole Agora run on this machine: DHT seed, workers and trainers, each its own process.

    python tools/swarm.py up [--config examples/tiny.toml] [--replicas 2] [--trainers 1] [--lanes 2] [--microbatch 4]
                             [--samples N] [--duration S] [--run-dir DIR] [--open]
    python tools/swarm.py status [--run-dir DIR]               # its processes, authorizer, DHT
    python tools/swarm.py kill-worker STAGE [--run-dir DIR]    # SIGKILL one worker of STAGE
    python tools/swarm.py add-worker STAGE [--run-dir DIR]     # start one more worker for STAGE
    python tools/swarm.py restart-worker NAME [--run-dir DIR]  # start a killed worker again, --resume
    python tools/swarm.py down [--run-dir DIR]                 # stop a swarm started elsewhere
    python tools/swarm.py dashboard [--run-dir DIR]            # the running monitor's URL

``up`` makes the data shards if needed (from the Python standard library's sources, with the
run's tokenizer: a BPE learned from them for examples/tiny.toml, in .agora/shards/bpe-512), starts
everything on 127.0.0.1 with one log file per process under the run directory, prints a
status line every few seconds (step per stage, loss, tokens/s, workers per stage, averaging
success), and stops everything when the trainers are done, after --duration, or on Ctrl-C.
The processes of a swarm are listed in RUN_DIR/swarm.json, which the other commands read.

``up`` also starts the health monitor (``agora-monitor serve``, its history in
RUN_DIR/monitor.db) and prints its dashboard's URL: loss, throughput, workers per stage, every
node, and the alerts firing (a killed worker shows there within one --monitor-period).

A swarm is authorized by default, like a public run: ``up`` creates an authorizer key, writes
RUN_DIR/run.toml (the config with ``[admission] mode = "authorized"`` and that key; every
node runs on it), opens the account ``swarm`` and starts ``agora-authorizer serve``, which
admits every worker and trainer and places each worker on a stage (``authorizer.py``).
``add-worker STAGE`` and ``restart-worker`` pin the worker's key to its stage first. ``--open``
runs without an authorizer: each worker is told its stage.

Every worker checkpoints into RUN_DIR/checkpoints/<name>/ (and once more when it stops).
Trainers get the training shards only; the shard set's validation split (documents held out
by make_shards) is for evaluation. When the swarm has stopped, ``up`` exports the model from
the workers' final checkpoints to RUN_DIR/model.safetensors and prints its held-out loss (per
token and in bits per byte) and a short text sample, then the cost of decentralization: the
swarm's samples/s next to the same model's trained centralized on this machine for a few
seconds (``reference_train.py``; ``--no-export`` skips all of that; ``results.py``).

This file is the command line (``agora-localswarm``; ``python tools/swarm.py`` is the same
command); starting, tracking and stopping the processes is ``processes.py``, reading the
swarm's state and printing it is ``status.py``. It runs from a checkout (``checkout.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import click

from agora_core.config import DataConfig, load_run_config
from agora_core.observability.logs import configure_logging
from agora_localswarm import checkout
from agora_localswarm.authorizer import authorize, db_url
from agora_localswarm.operator import prepare_operator
from agora_localswarm.processes import (
    SwarmFile,
    alive,
    kill_last_worker,
    monitor_db,
    restart_worker,
    start_authorizer,
    start_monitor,
    start_seed,
    start_trainer,
    start_worker,
    stop_all,
    wait_for_line,
    wait_placed,
    wait_serving,
)
from agora_localswarm.results import export_and_evaluate, report_efficiency
from agora_localswarm.status import describe_swarm, summarize, watch
from agora_trainer.data.manifest import check_run_tokenizer, read_manifest
from agora_trainer.data.rotation_record import format_ranges
from agora_trainer.data.shards import open_shard_set
from agora_trainer.data.tokenizer import digest
from agora_trainer.errors import DataError

# Documents held out for the final held-out loss: on 8 MB of the standard library, some 25
# files. Fewer let one codec table or file of numbers dominate the held-out tokens.
VALIDATION_FRACTION = 0.05


def default_shards_dir(data: DataConfig) -> Path:
    """Where the main job keeps the shards of the run's tokenizer: one folder per tokenizer, so
    switching tokenizers never reuses (or overwrites) another's shards."""
    if data.tokenizer_kind == "bpe":
        name = f"bpe-{data.vocab_size}"
    elif data.tokenizer_kind == "file":
        try:
            name = f"json-{digest(Path(data.tokenizer).read_bytes())[:12]}"
        except OSError as exc:
            raise click.ClickException(f"data.tokenizer: cannot read {data.tokenizer}: {exc}") from None
    else:
        name = "bytes"
    return checkout.shards_root() / name


def ensure_shards(shards: Path, config: str, min_samples: int) -> None:
    """Make shards unless ``shards`` holds ``min_samples`` training samples and a validation
    split, made with the run's tokenizer. The folder is shared by every run of the checkout:
    one process at a time checks and makes it (a lock file beside it), so two starting at
    once never write the same shard files; the second finds the first's set. A set too small
    for a later caller is made anew beside it and swapped in whole (:func:`_swap_in`): a run
    already training on the old one, or starting meanwhile, never reads a half-made folder."""
    shards.parent.mkdir(parents=True, exist_ok=True)
    with _locked(shards.parent / f".{shards.name}.lock", shards):
        if _has_shards(shards, config, min_samples):
            return
        run = load_run_config(config)
        # Text for the samples asked (at most 4 bytes per token of a small BPE; 1 for bytes), 8 MB at least.
        max_mb = max(8.0, min_samples * run.model.seq_len * 4 * 1.25 / 1e6)
        click.echo(f"making data shards in {shards} from the Python standard library's sources ...")
        staging = shards.parent / f".{shards.name}.making"
        shutil.rmtree(staging, ignore_errors=True)  # a make that died half-way
        command = checkout.tool("make_shards.py", str(staging), "--config", config)
        command += [
            "--shards",
            "8",
            "--max-mb",
            f"{max_mb:g}",
            "--validation-fraction",
            str(VALIDATION_FRACTION),
        ]
        subprocess.run(command, check=True)
        _swap_in(staging, shards)


def _swap_in(staging: Path, shards: Path) -> None:
    """Put the finished set ``staging`` at ``shards`` in two renames; a run that opened the old
    set's files keeps reading them until it closes them."""
    old = shards.parent / f".{shards.name}.old-{os.getpid()}"
    if shards.exists():
        os.rename(shards, old)
    os.rename(staging, shards)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_file: Path, shards: Path) -> Iterator[None]:
    with open(lock_file, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            click.echo(f"waiting for another process making the shards in {shards} ...")
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when that process's make_shards ends
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _has_shards(shards: Path, config: str, min_samples: int) -> bool:
    run = load_run_config(config)
    with contextlib.suppress(DataError):
        train = open_shard_set(shards, "train")
        check_run_tokenizer(train.tokenizer, run.data, run.model.vocab_size, where=str(shards))
        held_out = open_shard_set(shards, "validation", verify=False)  # evaluate.py verifies it
        enough = sum(s.sample_count(run.model.seq_len) for s in train.shards) >= min_samples
        return enough and bool(held_out.shards)
    return False


def trainer_ranges(shards: Path, index: int, trainers: int) -> str:
    """Trainer ``index``'s share: every trainers-th training shard from ``index`` (its
    --shard-ranges, until the operator rotates them: tools/rotate_shards.py)."""
    ids = [s.id for s in read_manifest(shards).split("train")][index::trainers]
    return format_ranges(ids)


# --- commands --------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a local Agora swarm (every node its own process, on 127.0.0.1)."""


run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=lambda: checkout.default_run_dir(),
    show_default="runs/latest in the checkout",
    help="Where logs, keys and swarm.json live.",
)


@main.command()
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False),
    default=lambda: str(checkout.example_config()),
    show_default="examples/tiny.toml in the checkout",
)
@click.option(
    "--shards", type=click.Path(file_okay=False, path_type=Path), help="Data shards (made if missing)."
)
@click.option("--replicas", type=int, default=2, show_default=True, help="Workers per stage.")
@click.option("--trainers", type=int, default=1, show_default=True, help="Trainer processes.")
@click.option("--lanes", type=int, default=2, show_default=True, help="Microbatches in flight per trainer.")
@click.option("--microbatch", type=int, default=4, show_default=True, help="Samples a lane sends at once.")
@click.option("--samples", type=int, help="Samples per trainer; the swarm stops when they are done.")
@click.option("--duration", type=float, help="Stop after this many seconds.")
@click.option(
    "--status-interval", type=float, default=5.0, show_default=True, help="Seconds between status lines."
)
@click.option(
    "--trainer-arg", "trainer_args", multiple=True, help="Extra argument for every trainer (repeatable)."
)
@click.option(
    "--worker-arg", "worker_args", multiple=True, help="Extra argument for every worker (repeatable)."
)
@click.option(
    "--export/--no-export",
    default=True,
    show_default=True,
    help="At the end, export the model and print its held-out loss and a sample.",
)
@click.option(
    "--open",
    "open_run",
    is_flag=True,
    help="No authorizer: an open run, each worker told its stage (the config's [admission] mode stays).",
)
@click.option(
    "--monitor/--no-monitor",
    "with_monitor",
    default=True,
    show_default=True,
    help="Start the health monitor and its dashboard (--no-monitor: one process less).",
)
@click.option(
    "--monitor-http",
    default="127.0.0.1:0",
    show_default=True,
    help="HOST:PORT of the monitor's dashboard (port 0: a free one; the URL is printed).",
)
@click.option(
    "--monitor-period", type=float, default=5.0, show_default=True, help="Seconds between monitor snapshots."
)
@run_dir_option
def up(
    config,
    shards,
    replicas,
    trainers,
    lanes,
    microbatch,
    samples,
    duration,
    status_interval,
    worker_args,
    trainer_args,
    export,
    open_run,
    with_monitor,
    monitor_http,
    monitor_period,
    run_dir,
) -> None:
    """Start a swarm and watch it train until it is done, --duration passes, or Ctrl-C."""
    configure_logging(fmt="console", level="warning")  # this process's own DHT member: quiet
    run = load_run_config(config)
    if replicas < 1 or trainers < 1 or lanes < 1 or microbatch < 1:
        raise click.BadParameter("--replicas, --trainers, --lanes and --microbatch must be >= 1")
    shards = shards or default_shards_dir(run.data)
    ensure_shards(shards, config, (samples or 1) * trainers)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "keys"):
        (run_dir / sub).mkdir(exist_ok=True)
    if (run_dir / "swarm.json").exists():
        old = SwarmFile.load(run_dir)
        if any(m.alive and alive(m.pid, m.started) for m in old.members):
            raise click.ClickException(f"a swarm is already running in {run_dir}: `swarm.py down` it first")
    # A fresh run (keys are kept): no old logs, loss curves, trainer positions, checkpoints.
    shutil.rmtree(run_dir / "data", ignore_errors=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    (run_dir / "model.safetensors").unlink(missing_ok=True)
    for old_db in run_dir.glob("monitor.db*"):  # the last run's history (and its -wal, -shm)
        old_db.unlink()
    for old_file in [*run_dir.glob("logs/*.log"), *run_dir.glob("*.losses.jsonl")]:
        old_file.unlink()
    (run_dir / "data").mkdir()
    if open_run and run.admission.authorized:
        raise click.BadParameter(
            f'{config} says [admission] mode = "authorized": --open needs an open config'
        )
    swarm = SwarmFile(str(run_dir), str(Path(config).resolve()), authorized=not open_run)
    if swarm.authorized:
        swarm.config = str(authorize(run_dir, config))  # every node runs on RUN_DIR/run.toml
    # the operator's key (tools/inject.py --run-dir), and the config that makes nodes obey it
    swarm.config = prepare_operator(run_dir, swarm.config, authorized=swarm.authorized)
    swarm.save()  # replaces the last run's file: what `finally` stops is this run's
    started = time.monotonic()
    signal.signal(signal.SIGTERM, _interrupted)  # `kill` stops the swarm like Ctrl-C does
    try:
        start_seed(swarm)
        click.echo(
            f"run {run.name!r}: {run.model.n_stages} stages x {replicas} workers, {trainers} x {lanes} lanes x {microbatch} samples"
        )
        click.echo(f"  dht seed   {swarm.seed_address}   logs in {run_dir / 'logs'}")
        if swarm.authorized:
            start_authorizer(swarm)
            click.echo(f"  authorizer {swarm.authorizer_address}   account swarm, database {db_url(run_dir)}")
        if with_monitor:
            dashboard_url = start_monitor(swarm, http=monitor_http, period_s=monitor_period)
            click.echo(f"  dashboard  {dashboard_url}   monitor database {monitor_db(swarm)}")
        workers = [  # an authorized swarm's are placed by the authorizer, the same number per stage
            start_worker(swarm, None if swarm.authorized else stage, worker_args)
            for stage in range(run.model.n_stages)
            for _ in range(replicas)
        ]
        for member, proc in workers:
            wait_placed(member, proc)
            member.address = wait_serving(member, proc)
            swarm.save()
        stages = [sum(m.stage == s for m, _ in workers) for s in range(run.model.n_stages)]
        click.echo(
            f"  workers    {len(workers)} serving, per stage {stages}; checkpoints in {run_dir / 'checkpoints'}"
        )
        manifest = read_manifest(shards)
        if len(manifest.split("train")) < trainers:
            raise click.ClickException(f"{shards} has fewer training shards than --trainers {trainers}")
        trainer_procs = [
            start_trainer(
                swarm,
                t,
                shards,
                shard_ranges=trainer_ranges(shards, t, trainers),
                lanes=lanes,
                microbatch=microbatch,
                samples=samples,
                status_interval_s=status_interval,
                extra=trainer_args,
            )
            for t in range(trainers)
        ]
        click.echo(
            f"  trainers   {trainers} started on {len(manifest.split('train'))} shards of {shards} "
            f"({manifest.documents.get('validation', 0)} documents held out); tokenizer "
            f"{manifest.tokenizer.describe()}; status every {status_interval:g} s (Ctrl-C stops the swarm)"
        )
        asyncio.run(watch(swarm, trainer_procs, started, duration, status_interval))
    except KeyboardInterrupt:
        click.echo("stopping the swarm ...")
    finally:
        stop_all(SwarmFile.load(run_dir))  # kill-worker and add-worker may have changed it
    rate = summarize(run_dir, started, run.model.seq_len)
    if export:
        export_and_evaluate(run_dir, swarm.config, shards)
        report_efficiency(rate, config, shards)


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


@main.command("kill-worker")
@click.argument("stage", type=int)
@run_dir_option
def kill_worker(stage, run_dir) -> None:
    """SIGKILL one live worker of STAGE (an abrupt departure)."""
    victim = kill_last_worker(SwarmFile.load(run_dir), stage)
    if victim is None:
        raise click.ClickException(f"stage {stage} has no live worker in {run_dir}")
    click.echo(f"killed {victim.name} (stage {stage}, pid {victim.pid})")


@main.command("add-worker")
@click.argument("stage", type=int)
@run_dir_option
def add_worker(stage, run_dir) -> None:
    """Start one more worker for STAGE in a running swarm (pinned there, in an authorized
    swarm); returns once it serves."""
    swarm = SwarmFile.load(run_dir)
    run = load_run_config(swarm.config)
    if not 0 <= stage < run.model.n_stages:
        raise click.BadParameter(f"the run has stages 0..{run.model.n_stages - 1}")
    member, proc = start_worker(swarm, stage)
    placed = wait_placed(member, proc)
    if placed != stage:
        raise click.ClickException(
            f"{member.name} was placed on stage {placed}, not {stage}; see {member.log}"
        )
    member.address = wait_serving(member, proc)
    swarm.save()
    click.echo(f"added {member.name} on stage {stage} at {member.address} (pid {member.pid})")


@main.command("restart-worker")
@click.argument("name")
@run_dir_option
def restart_worker_command(name, run_dir) -> None:
    """Start the stopped or killed worker NAME (e.g. worker-3) again with --resume: same key,
    same checkpoint directory, same stage (pinned, in an authorized swarm); it continues from
    its newest valid checkpoint."""
    swarm = SwarmFile.load(run_dir)
    member = next((m for m in swarm.members if m.name == name), None)
    if member is None:
        workers = ", ".join(m.name for m in swarm.members if m.role == "worker")
        raise click.BadParameter(f"no worker {name!r} in {run_dir}; its workers: {workers}")
    proc, offset = restart_worker(swarm, member)
    wait_placed(member, proc, after_bytes=offset)
    member.address = wait_serving(member, proc, after_bytes=offset)
    swarm.save()
    resumed = wait_for_line(proc, Path(member.log), "  resumed    ", 10.0, after_bytes=offset)
    click.echo(f"restarted {name} at {member.address} (pid {member.pid}), resumed from {resumed}")


@main.command()
@run_dir_option
def status(run_dir) -> None:
    """What the swarm in RUN_DIR runs: its processes, its authorizer and how many nodes it
    admitted, and what its DHT says (steps, loss, workers per stage)."""
    swarm = SwarmFile.load(run_dir)
    for line in describe_swarm(swarm):
        click.echo(line)


@main.command()
@run_dir_option
def dashboard(run_dir) -> None:
    """Print the URL of the running swarm's dashboard (its health monitor)."""
    swarm = SwarmFile.load(run_dir)
    monitor = next(
        (m for m in swarm.members if m.role == "monitor" and m.alive and alive(m.pid, m.started)), None
    )
    if monitor is None:
        raise click.ClickException(f"no monitor is running in {run_dir}")
    click.echo(monitor.address)


@main.command()
@run_dir_option
def down(run_dir) -> None:
    """Stop every process of the swarm in RUN_DIR."""
    stop_all(SwarmFile.load(run_dir))
    click.echo(f"stopped the swarm in {run_dir}")
