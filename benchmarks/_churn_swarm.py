"""A local swarm a benchmark drives itself: tools/swarm.py's processes, without its watch loop.

``swarm.py up`` owns its processes until the trainers finish; a churn soak must also replace
workers that died and restart a trainer that crashed, so it starts the same processes with
the same functions (``agora_localswarm.processes``: the DHT seed, the authorizer, the health
monitor, workers placed and pinned by the authorizer, trainers) and keeps them itself. Every
call that writes RUN_DIR/swarm.json holds one lock: replacements run on threads.

Also :func:`run_up`: ``swarm.py up`` as a user runs it, to its end, with a deadline.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agora_core.admission.credential import SignedCredential
from agora_core.admission.credential_file import load_credential
from agora_core.config import RunConfig, load_run_config
from agora_core.identity import NodeKey
from agora_localswarm import processes
from agora_localswarm.authorizer import authorize
from agora_localswarm.cli import ensure_shards
from agora_localswarm.operator import credential_file, key_file, prepare_operator

ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")
UP_STOP_S = 60.0  # `up` stopping its nodes on SIGTERM (trainers, then workers, then the rest)
DOWN_S = 120.0  # `swarm.py down`


def run_up(flags: list[str], run_dir: Path, *, timeout_s: float, capture: bool = False, quiet: bool = False):
    """``swarm.py up FLAGS --run-dir RUN_DIR`` to its end (a CompletedProcess; ``capture``: its
    output as text, ``quiet``: its stdout dropped). TimeoutError after ``timeout_s``; every node
    it started is stopped however it ends."""
    stdout = subprocess.PIPE if capture else subprocess.DEVNULL if quiet else None
    command = [sys.executable, SWARM, "up", *flags, "--run-dir", str(run_dir)]
    proc = subprocess.Popen(command, stdout=stdout, stderr=subprocess.PIPE if capture else None, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"`swarm.py up` in {run_dir} to finish, within {timeout_s:g} s") from None
    finally:
        stop_up(proc, run_dir)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def stop_up(proc: subprocess.Popen, run_dir: Path, *, down: bool = False) -> None:
    """Stop a ``swarm.py up`` still running and the nodes it started: SIGTERM first (it stops
    its nodes in order; SIGKILL would leave them running, each in its own session), then
    ``swarm.py down`` for any it left (``down``: also after a clean exit, for nodes another
    command such as ``add-worker`` started)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=UP_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
    # an `up` that exits 0, by itself or on SIGTERM, stopped its nodes on the way out
    if (down or proc.returncode != 0) and (run_dir / "swarm.json").exists():
        command = [sys.executable, SWARM, "down", "--run-dir", str(run_dir)]
        subprocess.run(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=DOWN_S, check=False
        )


@dataclass
class DrivenSwarm:
    run_dir: Path
    config: str  # the run config given; the swarm runs on RUN_DIR/run.toml
    shards: Path
    replicas: int
    lanes: int
    worker_args: tuple[str, ...] = ()
    swarm: processes.SwarmFile | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    trainer_dir: Path | None = None

    run: RunConfig | None = None  # the config every node runs on, once up

    def up(self) -> None:
        """A fresh authorized, monitored swarm: seed, authorizer, monitor, ``replicas`` workers
        per stage (placed by the authorizer), serving; no trainer yet."""
        run = load_run_config(self.config)
        ensure_shards(self.shards, self.config, 1)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        for sub in ("logs", "keys", "data"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        swarm = processes.SwarmFile(str(self.run_dir), str(Path(self.config).resolve()), authorized=True)
        swarm.config = str(authorize(self.run_dir, self.config))
        swarm.config = prepare_operator(self.run_dir, swarm.config, authorized=True)
        swarm.save()
        self.swarm = swarm
        self.run = load_run_config(swarm.config)
        processes.start_seed(swarm)
        processes.start_authorizer(swarm)
        processes.start_monitor(swarm)
        started = [self.start_worker(None) for _ in range(run.model.n_stages * self.replicas)]
        for member, proc in started:
            self.wait_serving(member, proc)
        self.trainer_dir = self.shards  # one trainer reads every shard

    def start_worker(self, stage: int | None, program: tuple[str, ...] = ("agora_worker",)):
        with self.lock:
            return processes.start_worker(self.swarm, stage, self.worker_args, program)

    def next_worker_key(self) -> NodeKey:
        """The key the next started worker will run with (its node id, known before it starts)."""
        with self.lock:
            name = f"worker-{sum(1 for m in self.swarm.members if m.role == 'worker')}"
            return NodeKey.load_or_create(processes.key_file(self.swarm, name))

    def wait_serving(self, member, proc) -> None:
        processes.wait_placed(member, proc)
        address = processes.wait_serving(member, proc)
        with self.lock:
            member.address = address
            self.swarm.save()

    def start_trainer(self, samples: int | None):
        """Trainer 0 (again, after a crash: same key, same shards, same state file); its process."""
        with self.lock:
            return processes.start_trainer(
                self.swarm, 0, self.trainer_dir, lanes=self.lanes, samples=samples, status_interval_s=30.0
            )

    def members(self, role: str) -> list[processes.Member]:
        with self.lock:
            return [m for m in self.swarm.members if m.role == role and m.alive]

    def reap(self) -> list[processes.Member]:
        """The members of swarm.json that died since the last call (marked dead there)."""
        dead = []
        with self.lock:
            for member in self.swarm.members:
                if member.alive and not processes.alive(member.pid, member.started):
                    member.alive = False
                    dead.append(member)
            if dead:
                self.swarm.save()
        return dead

    def trainer_running(self) -> bool:
        return any(processes.alive(m.pid, m.started) for m in self.members("trainer"))

    def operator(self) -> tuple[NodeKey, SignedCredential]:
        run = self.run
        key = NodeKey.load(key_file(self.run_dir))
        credential = load_credential(
            credential_file(self.run_dir),
            authorizer_public_key=run.admission.authorizer_key_bytes,
            run=run.name,
            public_key=key.public_key,
        )
        return key, credential

    def down(self) -> None:
        if self.swarm is not None:
            with self.lock:
                processes.stop_all(processes.SwarmFile.load(self.run_dir))

    def logs(self, role: str) -> list[Path]:
        return sorted((self.run_dir / "logs").glob(f"{role}-*.log"))

    def loss_log(self) -> Path:
        return self.run_dir / "trainer-0.losses.jsonl"
