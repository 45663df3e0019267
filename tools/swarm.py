#!/usr/bin/env python3
"""A whole Agora run on this machine: DHT seed, workers and trainers, each its own process.

    python tools/swarm.py up [--config examples/tiny.toml] [--replicas 2] [--trainers 1] [--lanes 8]
                             [--samples N] [--duration S] [--run-dir DIR]
    python tools/swarm.py kill-worker STAGE [--run-dir DIR]    # SIGKILL one worker of STAGE
    python tools/swarm.py add-worker STAGE [--run-dir DIR]     # start one more worker for STAGE
    python tools/swarm.py down [--run-dir DIR]                 # stop a swarm started elsewhere

``up`` makes the data shards if needed (from the Python standard library's sources), starts
everything on 127.0.0.1 with one log file per process under the run directory, prints a
status line every few seconds (step per stage, loss, tokens/s, workers per stage, averaging
success), and stops everything when the trainers are done, after --duration, or on Ctrl-C.
The processes of a swarm are listed in RUN_DIR/swarm.json, which the other commands read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import click

from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.logs import configure_logging
from agora_core.schema import (
    StageProgress,
    TrainerProgress,
    WorkerAnnouncement,
    averaging_summary_key,
    stage_progress_key,
    stage_workers_key,
    trainer_progress_key,
)
from agora_trainer.shards import open_shards

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "tiny.toml"
DEFAULT_RUN_DIR = ROOT / "runs" / "latest"
STARTUP_TIMEOUT_S = 120.0  # torch imports on a busy 2-core machine are slow
# One compute thread per process: a swarm on a laptop has more processes than cores.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGORA_LOG_FORMAT": "console"}


@dataclass
class Member:
    role: str  # dht, worker, trainer
    name: str  # e.g. worker-1-0
    pid: int
    log: str
    stage: int | None = None
    address: str = ""
    alive: bool = True


@dataclass
class SwarmFile:
    """RUN_DIR/swarm.json: what ``up`` started, so ``down``/``kill-worker``/``add-worker`` can act."""

    run_dir: str
    config: str
    seed_address: str = ""
    members: list[Member] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / "swarm.json"

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(self.path)  # readers never see half a file

    @classmethod
    def load(cls, run_dir: Path) -> SwarmFile:
        path = run_dir / "swarm.json"
        if not path.exists():
            raise click.ClickException(f"no swarm in {run_dir} (no swarm.json): start one with `swarm.py up`")
        data = json.loads(path.read_text())
        return cls(
            data["run_dir"], data["config"], data["seed_address"], [Member(**m) for m in data["members"]]
        )


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **CHILD_ENV},
            start_new_session=True,  # Ctrl-C reaches `up`, which stops the children in order
        )
    finally:
        log.close()


def _wait_for_line(proc: subprocess.Popen, log_path: Path, prefix: str, timeout_s: float) -> str:
    """The rest of the first line in the child's log that starts with ``prefix``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        if proc.poll() is not None:
            raise click.ClickException(f"{log_path.name}: exited with code {proc.returncode}; see {log_path}")
        time.sleep(0.1)  # polling a file another process writes: there is nothing to wait on
    raise click.ClickException(
        f"{log_path.name}: no {prefix.strip()!r} line after {timeout_s:g} s; see {log_path}"
    )


def start_worker(
    swarm: SwarmFile, stage: int, extra: tuple[str, ...] = ()
) -> tuple[Member, subprocess.Popen]:
    run_dir = Path(swarm.run_dir)
    index = sum(1 for m in swarm.members if m.role == "worker" and m.stage == stage)
    name = f"worker-{stage}-{index}"
    log = run_dir / "logs" / f"{name}.log"
    proc = _spawn(
        [
            "-m",
            "agora_worker",
            "run",
            "--config",
            swarm.config,
            "--stage",
            str(stage),
            "--bootstrap",
            swarm.seed_address,
            "--key-file",
            str(run_dir / "keys" / f"{name}.key"),
            "--device",
            "cpu",
            # steps come every second or so here: check the stage's progress often, so a step
            # holds close to target_batch_size samples, as in the reference
            "--progress-interval",
            "0.1",
            *extra,
        ],
        log,
    )
    member = Member("worker", name, proc.pid, str(log), stage=stage)
    swarm.members.append(member)
    swarm.save()
    return member, proc


def ensure_shards(shards: Path, min_samples: int, seq_len: int) -> None:
    with contextlib.suppress(Exception):
        if sum(s.sample_count(seq_len) for s in open_shards(shards)) >= min_samples:
            return
    click.echo(f"making data shards in {shards} from the Python standard library's sources ...")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_shards.py"),
            str(shards),
            "--shards",
            "8",
            "--max-mb",
            "16",
        ],
        check=True,
    )


# --- status ----------------------------------------------------------------------------------------


class StatusReader:
    """A light DHT member of the swarm that reads what the nodes publish."""

    def __init__(self, run, seed_address: str):
        self.run = run
        self.node = DhtNode(key=NodeKey.generate(), config=run.dht, bootstrap=[seed_address])
        self._last: tuple[float, int] | None = None

    async def __aenter__(self) -> StatusReader:
        await self.node.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.node.stop()

    async def _values(self, key: str, parse) -> list:
        out = []
        with contextlib.suppress(AgoraError, TimeoutError):
            for value in (await self.node.get(key)).values():
                with contextlib.suppress(Exception):
                    out.append(parse(value.value))
        return out

    async def snapshot(self) -> dict:
        name, stages = self.run.name, self.run.model.n_stages
        workers, steps, averaging = [], [], []
        for stage in range(stages):
            announced = await self._values(stage_workers_key(name, stage), WorkerAnnouncement.from_value)
            workers.append(len(announced))
            progress = await self._values(stage_progress_key(name, stage), StageProgress.from_value)
            steps.append(max((p.step for p in progress), default=0))
            summaries = await self._values(averaging_summary_key(name, stage), dict)
            averaging.extend(s.get("averaging_success") for s in summaries)
        trainers = await self._values(trainer_progress_key(name), TrainerProgress.from_value)
        tokens = sum(t.tokens for t in trainers)
        now = time.monotonic()
        rate = None
        if self._last is not None and now > self._last[0]:
            rate = (tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, tokens)
        losses = [t.loss_ema for t in trainers if t.loss_ema is not None]
        averaged = [a for a in averaging if isinstance(a, (int, float))]
        return {
            "steps": steps,
            "workers": workers,
            "samples": sum(t.samples for t in trainers),
            "loss": sum(losses) / len(losses) if losses else None,
            "tokens_per_s": rate,
            "averaging_success": sum(averaged) / len(averaged) if averaged else None,
        }


def format_status(s: dict, elapsed: float) -> str:
    loss = "-" if s["loss"] is None else f"{s['loss']:.3f}"
    rate = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
    avg = "-" if s["averaging_success"] is None else f"{s['averaging_success']:.2f}"
    return (
        f"[{elapsed:6.0f} s] step/stage {s['steps']}  loss {loss}  tokens/s {rate}  "
        f"samples {s['samples']}  workers/stage {s['workers']}  averaging {avg}"
    )


# --- commands --------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a local Agora swarm (every node its own process, on 127.0.0.1)."""


run_dir_option = click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_RUN_DIR,
    show_default=True,
    help="Where logs, keys and swarm.json live.",
)


@main.command()
@click.option(
    "--config", type=click.Path(exists=True, dir_okay=False), default=str(DEFAULT_CONFIG), show_default=True
)
@click.option(
    "--shards", type=click.Path(file_okay=False, path_type=Path), help="Data shards (made if missing)."
)
@click.option("--replicas", type=int, default=2, show_default=True, help="Workers per stage.")
@click.option("--trainers", type=int, default=1, show_default=True, help="Trainer processes.")
@click.option("--lanes", type=int, default=4, show_default=True, help="Samples in flight per trainer.")
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
@run_dir_option
def up(
    config,
    shards,
    replicas,
    trainers,
    lanes,
    samples,
    duration,
    status_interval,
    worker_args,
    trainer_args,
    run_dir,
) -> None:
    """Start a swarm and watch it train until it is done, --duration passes, or Ctrl-C."""
    configure_logging(fmt="console", level="warning")  # this process's own DHT member: quiet
    run = load_run_config(config)
    if replicas < 1 or trainers < 1 or lanes < 1:
        raise click.BadParameter("--replicas, --trainers and --lanes must be >= 1")
    shards = shards or ROOT / ".agora" / "shards" / run.data.tokenizer
    ensure_shards(shards, (samples or 1) * trainers, run.model.seq_len)
    run_dir.mkdir(parents=True, exist_ok=True)
    for sub in ("logs", "keys"):
        (run_dir / sub).mkdir(exist_ok=True)
    if (run_dir / "swarm.json").exists():
        old = SwarmFile.load(run_dir)
        if any(m.alive and _alive(m.pid) for m in old.members):
            raise click.ClickException(f"a swarm is already running in {run_dir}: `swarm.py down` it first")
    # A fresh run (keys are kept): no old logs, loss curves or trainer positions.
    shutil.rmtree(run_dir / "data", ignore_errors=True)
    for old_file in [*run_dir.glob("logs/*.log"), *run_dir.glob("*.losses.jsonl")]:
        old_file.unlink()
    (run_dir / "data").mkdir()
    swarm = SwarmFile(str(run_dir), str(Path(config).resolve()))
    procs: dict[str, subprocess.Popen] = {}
    started = time.monotonic()
    try:
        log = run_dir / "logs" / "dht.log"
        seed = _spawn(
            [
                "-m",
                "agora_core",
                "dht",
                "serve",
                "--config",
                swarm.config,
                "--key-file",
                str(run_dir / "keys" / "dht.key"),
            ],
            log,
        )
        procs["dht"] = seed
        swarm.members.append(Member("dht", "dht", seed.pid, str(log)))
        swarm.seed_address = _wait_for_line(seed, log, "  serving    ", STARTUP_TIMEOUT_S)
        swarm.save()
        click.echo(
            f"run {run.name!r}: {run.model.n_stages} stages x {replicas} workers, {trainers} x {lanes} lanes"
        )
        click.echo(f"  dht seed   {swarm.seed_address}   logs in {run_dir / 'logs'}")
        workers = []
        for stage in range(run.model.n_stages):
            for _ in range(replicas):
                member, proc = start_worker(swarm, stage, worker_args)
                procs[member.name] = proc
                workers.append((member, proc))
        for member, proc in workers:
            member.address = _wait_for_line(proc, Path(member.log), "  serving    ", STARTUP_TIMEOUT_S)
        swarm.save()
        click.echo(f"  workers    {len(workers)} serving")
        trainer_procs = []
        shard_files = sorted(p for p in shards.glob("*.json"))
        for t in range(trainers):
            # each trainer gets every trainers-th shard: no sample is trained twice
            mine = run_dir / "data" / f"trainer-{t}"
            mine.mkdir(exist_ok=True)
            for meta in shard_files[t::trainers]:
                for path in (meta, meta.with_suffix(".tokens")):
                    link = mine / path.name
                    if not link.exists():
                        link.symlink_to(path.resolve())
            name = f"trainer-{t}"
            log = run_dir / "logs" / f"{name}.log"
            args = [
                "-m",
                "agora_trainer",
                "run",
                "--config",
                swarm.config,
                "--shards",
                str(mine),
                "--bootstrap",
                swarm.seed_address,
                "--key-file",
                str(run_dir / "keys" / f"{name}.key"),
                "--lanes",
                str(lanes),
                "--loss-log",
                str(run_dir / f"{name}.losses.jsonl"),
                "--progress-interval",
                "1",
                "--status-interval",
                str(status_interval),
            ]
            if samples:
                args += ["--max-samples", str(samples)]
            args += trainer_args
            proc = _spawn(args, log)
            procs[name] = proc
            trainer_procs.append(proc)
            swarm.members.append(Member("trainer", name, proc.pid, str(log)))
        swarm.save()
        click.echo(
            f"  trainers   {trainers} started; status every {status_interval:g} s (Ctrl-C stops the swarm)"
        )
        asyncio.run(_watch(run, swarm, trainer_procs, started, duration, status_interval))
    except KeyboardInterrupt:
        click.echo("stopping the swarm ...")
    finally:
        stop_all(SwarmFile.load(run_dir) if (run_dir / "swarm.json").exists() else swarm)
    _summary(run_dir, started, run.model.seq_len)


async def _watch(run, swarm: SwarmFile, trainers, started: float, duration, interval: float) -> None:
    async with StatusReader(run, swarm.seed_address) as reader:
        while True:
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                if all(p.poll() is not None for p in trainers):
                    click.echo(format_status(await reader.snapshot(), time.monotonic() - started))
                    click.echo("trainers finished")
                    return
                if duration is not None and time.monotonic() - started > duration:
                    click.echo(f"--duration {duration:g} s reached")
                    return
                await asyncio.sleep(0.2)
            click.echo(format_status(await reader.snapshot(), time.monotonic() - started))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours still answers kill(0); reap it if it is ours
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    return True


def stop_all(swarm: SwarmFile, timeout_s: float = 20.0) -> None:
    """SIGTERM trainers first (their lanes finish), then workers, then the seed; SIGKILL stragglers."""
    order = {"trainer": 0, "worker": 1, "dht": 2}
    for role in sorted(order, key=order.get):
        members = [m for m in swarm.members if m.role == role and _alive(m.pid)]
        for m in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(m.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(_alive(m.pid) for m in members) and time.monotonic() < deadline:
            time.sleep(0.1)  # other processes' exits: polled with a deadline
        for m in members:
            if _alive(m.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGKILL)
    for m in swarm.members:
        m.alive = False
    swarm.save()


def _summary(run_dir: Path, started: float, seq_len: int) -> None:
    records = []
    for path in sorted(run_dir.glob("trainer-*.losses.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                records.append((record["t"], record["loss"]))
    records.sort()
    losses = [loss for _, loss in records]
    if not losses:
        click.echo("no samples completed")
        return
    window = max(1, min(64, len(losses) // 4))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    click.echo(
        f"done in {time.monotonic() - started:.0f} s: {len(losses)} samples, "
        f"loss {first:.3f} (first {window}) -> {last:.3f} (last {window})"
    )
    if len(records) > 1 and records[-1][0] > records[0][0]:
        rate = (len(records) - 1) / (records[-1][0] - records[0][0])
        click.echo(f"training throughput: {rate:.1f} samples/s, {rate * seq_len:.0f} tokens/s")


@main.command("kill-worker")
@click.argument("stage", type=int)
@run_dir_option
def kill_worker(stage, run_dir) -> None:
    """SIGKILL one live worker of STAGE (an abrupt departure)."""
    swarm = SwarmFile.load(run_dir)
    live = [m for m in swarm.members if m.role == "worker" and m.stage == stage and m.alive and _alive(m.pid)]
    if not live:
        raise click.ClickException(f"stage {stage} has no live worker in {run_dir}")
    victim = live[-1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.alive = False
    swarm.save()
    click.echo(f"killed {victim.name} (pid {victim.pid})")


@main.command("add-worker")
@click.argument("stage", type=int)
@run_dir_option
def add_worker(stage, run_dir) -> None:
    """Start one more worker for STAGE in a running swarm; returns once it serves."""
    swarm = SwarmFile.load(run_dir)
    run = load_run_config(swarm.config)
    if not 0 <= stage < run.model.n_stages:
        raise click.BadParameter(f"the run has stages 0..{run.model.n_stages - 1}")
    member, proc = start_worker(swarm, stage)
    member.address = _wait_for_line(proc, Path(member.log), "  serving    ", STARTUP_TIMEOUT_S)
    swarm.save()
    click.echo(f"added {member.name} at {member.address} (pid {member.pid})")


@main.command()
@run_dir_option
def down(run_dir) -> None:
    """Stop every process of the swarm in RUN_DIR."""
    stop_all(SwarmFile.load(run_dir))
    click.echo(f"stopped the swarm in {run_dir}")


if __name__ == "__main__":
    main()
