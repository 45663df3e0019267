"""The processes of a local swarm: starting, tracking and stopping its nodes.

Every node (the DHT seed, the authorizer, each worker, each trainer) is its own ``python -m ...``
process with its log file under the run directory; RUN_DIR/swarm.json (:class:`SwarmFile`)
lists them, so a later ``swarm.py`` command can act on a swarm another one started. Workers
are named in the order they were started (``worker-0``, ``worker-1``, ...): in an authorized
swarm the authorizer, not the swarm, decides each one's stage, which swarm.json records once
the worker says it (its ``  stage      N`` startup line).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import click

from agora_core.admission.credential_file import save_credential
from agora_core.identity import NodeKey
from agora_localswarm import authorizer, proc

STARTUP_TIMEOUT_S = 120.0  # torch imports on a busy 2-core machine are slow
# One compute thread per process: a swarm on a laptop has more processes than cores.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGORA_LOG_FORMAT": "console"}
SERVING_PREFIX = "  serving    "  # a node's startup line that carries its address
STAGE_PREFIX = "  stage      "  # a worker's startup line that names its stage (placed or given)
STOP_ORDER = ("trainer", "worker", "monitor", "authorizer", "dht")  # who stops first
DASHBOARD_PREFIX = "  dashboard  "  # the monitor's startup line that carries its URL


@dataclass
class Member:
    role: str  # dht, authorizer, worker, trainer
    name: str  # e.g. worker-3
    pid: int
    log: str
    stage: int | None = None  # a worker's, once known (in an authorized swarm: once placed)
    address: str = ""
    alive: bool = True
    node_id: str = ""
    # when the process started (clock ticks since boot; 0: unknown): a pid alone may be
    # another process's by the time `down` or `kill-worker` acts on it
    started: int = 0


@dataclass
class SwarmFile:
    """RUN_DIR/swarm.json: what ``up`` started, so ``down``/``kill-worker``/``add-worker`` can act."""

    run_dir: str
    config: str  # the run config every node is started with (an authorized swarm's run.toml)
    seed_address: str = ""
    members: list[Member] = field(default_factory=list)
    authorized: bool = False  # an authorizer admits the nodes (swarm.py up without --open)
    authorizer_address: str = ""

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
        known = {f.name for f in fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        return cls(**{**data, "members": [Member(**m) for m in data["members"]]})

    def node_flags(self) -> tuple[list[str], dict[str, str]]:
        """The flags and environment every worker and trainer is started with."""
        if not self.authorized:
            return [], {}
        run_dir = Path(self.run_dir)
        return authorizer.node_flags(self.authorizer_address), authorizer.node_env(run_dir)


def spawn(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **CHILD_ENV, **(env or {})},
            start_new_session=True,  # Ctrl-C reaches `up`, which stops the children in order
        )
    finally:
        log.close()


def wait_for_line(
    proc: subprocess.Popen, log_path: Path, prefix: str, timeout_s: float, *, after_bytes: int = 0
) -> str:
    """The rest of the first line in the child's log that starts with ``prefix`` (after the
    log's first ``after_bytes``: what an earlier process of the same name wrote)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(log_path, "rb") as f:
            f.seek(after_bytes)
            text = f.read().decode(errors="replace")
        for line in text.splitlines():
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        if proc.poll() is not None:
            raise click.ClickException(f"{log_path.name}: exited with code {proc.returncode}; see {log_path}")
        time.sleep(0.1)  # polling a file another process writes: there is nothing to wait on
    raise click.ClickException(
        f"{log_path.name}: no {prefix.strip()!r} line after {timeout_s:g} s; see {log_path}"
    )


def wait_serving(member: Member, proc: subprocess.Popen, *, after_bytes: int = 0) -> str:
    """The address a started node serves at, once its log says so."""
    return wait_for_line(proc, Path(member.log), SERVING_PREFIX, STARTUP_TIMEOUT_S, after_bytes=after_bytes)


def start_seed(swarm: SwarmFile) -> subprocess.Popen:
    """Start the DHT seed and record it; ``swarm.seed_address`` is set once it serves."""
    run_dir = Path(swarm.run_dir)
    log = run_dir / "logs" / "dht.log"
    key_path = run_dir / "keys" / "dht.key"
    args = ["-m", "agora_core", "dht", "serve", "--config", swarm.config, "--key-file", str(key_path)]
    key = NodeKey.load_or_create(key_path)
    if swarm.authorized:  # an operator's seed: a credential of role dht, from the swarm's authorizer
        credential = authorizer.operator_credential(run_dir, swarm.config, key, "dht")
        args += ["--credential", str(save_credential(credential, key_path.with_suffix(".credential")))]
    proc = spawn(args, log)
    member = Member("dht", "dht", proc.pid, str(log), started=process_start(proc.pid))
    swarm.members.append(member)
    address = wait_serving(member, proc)
    # in an authorized swarm the bootstrap address names the seed's key: <hex key>@address
    swarm.seed_address = f"{key.public_key.hex()}@{address}" if swarm.authorized else address
    swarm.save()
    return proc


def start_authorizer(swarm: SwarmFile) -> subprocess.Popen:
    """Start the authorizer (after the seed: it joins the DHT) and record it; its address is
    ``swarm.authorizer_address`` once it serves."""
    run_dir = Path(swarm.run_dir)
    log = run_dir / "logs" / "authorizer.log"
    proc = spawn(authorizer.serve_args(run_dir, swarm.config, swarm.seed_address), log)
    member = Member("authorizer", "authorizer", proc.pid, str(log), started=process_start(proc.pid))
    swarm.members.append(member)
    swarm.save()
    member.address = swarm.authorizer_address = wait_serving(member, proc)
    swarm.save()
    return proc


def monitor_db(swarm: SwarmFile) -> Path:
    """The monitor's database: SQLite, in the run directory."""
    return Path(swarm.run_dir) / "monitor.db"


def start_monitor(swarm: SwarmFile, *, http: str = "127.0.0.1:0", period_s: float = 5.0) -> str:
    """Start the health monitor (after the seed, and the authorizer in an authorized swarm:
    it joins the DHT with a monitor credential from it) and record it; returns the
    dashboard's URL, which is also the member's ``address`` in swarm.json."""
    run_dir = Path(swarm.run_dir)
    log = run_dir / "logs" / "monitor.log"
    key_path = run_dir / "keys" / "monitor.key"
    key = NodeKey.load_or_create(key_path)
    args = ["-m", "agora_monitor", "serve", "--config", swarm.config, "--bootstrap", swarm.seed_address]
    args += ["--db", str(monitor_db(swarm)), "--http", http, "--key-file", str(key_path)]
    args += ["--period-s", str(period_s), "--log-format", "console"]
    if swarm.authorized:
        credential = authorizer.operator_credential(run_dir, swarm.config, key, "monitor")
        args += ["--credential", str(save_credential(credential, key_path.with_suffix(".credential")))]
    proc = spawn(args, log)
    member = Member(
        "monitor", "monitor", proc.pid, str(log), node_id=key.node_id, started=process_start(proc.pid)
    )
    swarm.members.append(member)
    swarm.save()
    member.address = wait_for_line(proc, log, DASHBOARD_PREFIX, STARTUP_TIMEOUT_S)
    swarm.save()
    return member.address


def checkpoint_dir(swarm: SwarmFile, name: str) -> Path:
    """Where worker ``name`` keeps its checkpoints: one directory per worker."""
    return Path(swarm.run_dir) / "checkpoints" / name


def key_file(swarm: SwarmFile, name: str) -> Path:
    return Path(swarm.run_dir) / "keys" / f"{name}.key"


def _worker_args(
    swarm: SwarmFile,
    stage: int | None,
    name: str,
    extra: tuple[str, ...],
    program: tuple[str, ...] = ("agora_worker",),
) -> list[str]:
    """An open swarm's worker serves ``stage``; an authorized swarm's is placed (or pinned).
    ``program``: the module run (and its first arguments) in place of ``agora_worker``."""
    run_dir = Path(swarm.run_dir)
    flags, _ = swarm.node_flags()
    placement = flags if swarm.authorized else ["--stage", str(stage)]
    return [
        "-m",
        *program,
        "run",
        "--config",
        swarm.config,
        *placement,
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
        "--checkpoint-dir",
        str(checkpoint_dir(swarm, name)),
        *extra,
    ]


def start_worker(
    swarm: SwarmFile,
    stage: int | None,
    extra: tuple[str, ...] = (),
    program: tuple[str, ...] = ("agora_worker",),
) -> tuple[Member, subprocess.Popen]:
    """Start the next worker: on ``stage`` (an authorized swarm pins its key there first), or
    wherever the authorizer places it (``stage`` None; :func:`wait_placed` learns where).
    ``program``: what runs it (the benchmarks' attackers: ``agora_devkit.attacker ATTACK``)."""
    if stage is None and not swarm.authorized:
        raise click.ClickException("an open swarm's workers need a stage: nobody places them")
    run_dir = Path(swarm.run_dir)
    name = f"worker-{sum(1 for m in swarm.members if m.role == 'worker')}"
    node_id = NodeKey.load_or_create(key_file(swarm, name)).node_id  # known before it starts
    if swarm.authorized and stage is not None:
        authorizer.pin(run_dir, node_id, stage)
    log = run_dir / "logs" / f"{name}.log"
    proc = spawn(_worker_args(swarm, stage, name, extra, program), log, swarm.node_flags()[1])
    member = Member(
        "worker", name, proc.pid, str(log), stage=stage, node_id=node_id, started=process_start(proc.pid)
    )
    swarm.members.append(member)
    swarm.save()
    return member, proc


def wait_placed(member: Member, proc: subprocess.Popen, *, after_bytes: int = 0) -> int:
    """The stage a started worker serves, once its log says so (recorded in ``member``)."""
    line = wait_for_line(proc, Path(member.log), STAGE_PREFIX, STARTUP_TIMEOUT_S, after_bytes=after_bytes)
    member.stage = int(line.split()[0])
    return member.stage


def restart_worker(swarm: SwarmFile, member: Member) -> tuple[subprocess.Popen, int]:
    """Start a stopped or killed worker again under its own name, key and checkpoint
    directory, with ``--resume``: it continues from its newest valid checkpoint. Returns the
    process and where its lines begin in the (appended) log."""
    if member.role != "worker" or member.stage is None:
        raise click.ClickException(f"{member.name} is not a worker")
    if member.alive and alive(member.pid, member.started):
        raise click.ClickException(f"{member.name} is still running (pid {member.pid})")
    if swarm.authorized:  # back on the stage whose checkpoints it holds
        authorizer.pin(Path(swarm.run_dir), NodeKey.load(key_file(swarm, member.name)).node_id, member.stage)
    log = Path(member.log)
    offset = log.stat().st_size if log.exists() else 0
    proc = spawn(_worker_args(swarm, member.stage, member.name, ("--resume",)), log, swarm.node_flags()[1])
    member.pid, member.started, member.alive, member.address = proc.pid, process_start(proc.pid), True, ""
    swarm.save()
    return proc, offset


def start_trainer(
    swarm: SwarmFile,
    index: int,
    shards: Path,
    *,
    lanes: int,
    samples: int | None,
    status_interval_s: float,
    microbatch: int = 1,
    shard_ranges: str | None = None,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen:
    """Start trainer ``index`` on the shards in ``shards`` (those of ``shard_ranges``: all
    without) and record it in swarm.json; its position in them is kept in the run dir."""
    run_dir = Path(swarm.run_dir)
    name = f"trainer-{index}"
    log = run_dir / "logs" / f"{name}.log"
    flags, env = swarm.node_flags()
    args = [
        "-m",
        "agora_trainer",
        "run",
        *flags,
        "--config",
        swarm.config,
        "--shards",
        str(shards),
        "--bootstrap",
        swarm.seed_address,
        "--key-file",
        str(run_dir / "keys" / f"{name}.key"),
        "--lanes",
        str(lanes),
        "--microbatch",
        str(microbatch),
        "--loss-log",
        str(run_dir / f"{name}.losses.jsonl"),
        "--progress-interval",
        "1",
        "--status-interval",
        str(status_interval_s),
    ]
    args += ["--state-file", str(run_dir / "data" / f"{name}.state.json")]
    if shard_ranges is not None:
        args += ["--shard-ranges", shard_ranges]
    if samples:
        args += ["--max-samples", str(samples)]
    args += extra
    proc = spawn(args, log, env)
    swarm.members.append(Member("trainer", name, proc.pid, str(log), started=process_start(proc.pid)))
    swarm.save()  # at once: if starting the next one fails, `up` still stops this one
    return proc


def process_start(pid: int) -> int:
    """When process ``pid`` started, in clock ticks since boot (0 where /proc cannot say)."""
    found = proc.stat(pid)
    return 0 if found is None else found.started


def alive(pid: int, started: int = 0) -> bool:
    """Whether process ``pid`` runs, and is still the one that started at ``started``."""
    if started and process_start(pid) not in (0, started):
        return False  # the pid now belongs to another process
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


def kill_last_worker(swarm: SwarmFile, stage: int) -> Member | None:
    """SIGKILL the last started live worker of ``stage`` (None if it has none)."""
    live = [
        m
        for m in swarm.members
        if m.role == "worker" and m.stage == stage and m.alive and alive(m.pid, m.started)
    ]
    if not live:
        return None
    victim = live[-1]
    os.kill(victim.pid, signal.SIGKILL)
    victim.alive = False
    swarm.save()
    return victim


def stop_all(swarm: SwarmFile, timeout_s: float = 20.0) -> None:
    """SIGTERM trainers first (their lanes finish), then workers, then the authorizer, then the
    seed; SIGKILL stragglers."""
    for role in STOP_ORDER:
        members = [m for m in swarm.members if m.role == role and alive(m.pid, m.started)]
        for m in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(m.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(alive(m.pid, m.started) for m in members) and time.monotonic() < deadline:
            time.sleep(0.1)  # other processes' exits: polled with a deadline
        for m in members:
            if alive(m.pid, m.started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(m.pid, signal.SIGKILL)
    for m in swarm.members:
        m.alive = False
    swarm.save()
