"""A worker in an authorized run, against a real authorizer process (its own SQLite file, a
free 127.0.0.1 port): placed on a stage and serving only once admitted; stopped when its
credential is lost, by a refused refresh or by the DHT's revocation list, with the
credential_lost exit code. And the command line's rules on --stage and --authorizer."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from agora_core.config import parse_run_config
from agora_core.contract import DepartureReason
from agora_core.identity import NodeKey
from agora_core.schema import WorkerDeparture, parse_entries, stage_departures_key, stage_workers_key
from agora_devkit.authorizer import (
    OPEN_FLOORS,
    AuthorizerProcess,
    RunObserver,
    authorizer_process,
    write_run,
)
from agora_devkit.processes import ChildProcess, spawn_python, wait_until
from agora_devkit.runs import tiny_run_toml
from agora_worker.termination import EXIT_CODES

pytestmark = pytest.mark.slow
KEY = "ab" * 32
START_S = 60.0  # a worker process imports torch, is admitted, joins, announces
CLI_S = 60.0  # one worker command that exits at once (it imports torch first)


def run_toml(name: str, admission: str) -> str:
    """The admission tests' run; ``admission``: the [admission] table's lines, as text."""
    return tiny_run_toml(
        name,
        stages=2,
        dht={"suspicion_timeout_s": 1.0, "op_timeout_s": 1.0, "record_ttl_s": 3.0},
        averaging={"matchmaking_window_s": 1.0, "round_timeout_s": 5.0, "chunk_timeout_s": 2.0},
        termination={"check_interval_s": 0.1},
        extra=f"[admission]\n{admission}",
    )


@dataclass
class Admitted:
    child: ChildProcess
    node_id: str
    stage: int
    address: str


@contextlib.contextmanager
def authorized_run(
    tmp_path: Path, name: str, *, lifetime_s: float, authorizer_in_dht: bool = True
) -> Iterator[tuple[AuthorizerProcess, RunObserver]]:
    """Authorized run ``name``: the test's observer (a credentialed DHT member the worker joins
    through, the test's reader and caller), and an authorizer in the observer's DHT, where it
    publishes its revocation list (``authorizer_in_dht=False``: a DHT of its own, so the list
    never reaches the worker)."""
    key = NodeKey.generate()
    run = parse_run_config(run_toml(name, f"{OPEN_FLOORS}credential_lifetime_s = {lifetime_s}"))
    run, _ = write_run(tmp_path, run, key)
    with RunObserver(run, key) as observer:
        extra = ("--allow-local-build",) + (("--bootstrap", observer.peer) if authorizer_in_dht else ())
        with authorizer_process(tmp_path / "authz", run, key=key, extra=extra) as process:
            yield process, observer


@contextlib.contextmanager
def admitted_worker(tmp_path: Path, authz: AuthorizerProcess, observer: RunObserver) -> Iterator[Admitted]:
    """A worker process without --stage, admitted through ``authz`` and joined through
    ``observer`` (which knows its key once it serves); stopped however the block ends."""
    token = authz.add_account("acme")
    command = [
        *("-m", "agora_worker", "run", "--config", str(authz.config_file)),
        *("--authorizer", authz.address, "--account", "acme", "--bootstrap", observer.peer),
        *("--device", "cpu", "--key-file", str(tmp_path / "worker.key")),
        *("--progress-interval", "0.05", "--announce-interval", "0.2"),
    ]
    env = {"AGORA_ACCOUNT_TOKEN": token, "AGORA_LOG_LEVEL": "warning"}
    with spawn_python(command, env=env) as child:
        node_id = child.read_until("  node id    ", timeout_s=START_S)
        queued = child.read_until("  admission  ", timeout_s=START_S)  # the first answer: the queue's
        stage = int(child.read_until("  stage      ", timeout_s=START_S).split()[0])
        assert f"stage {stage}" in queued or queued.startswith("admitted"), queued
        address = child.read_until("  serving    ", timeout_s=START_S)
        wait_until(lambda: observer.knows(address), timeout_s=10, what="the worker in the observer's table")
        yield Admitted(child, node_id, stage, address)


def status(authz: AuthorizerProcess) -> dict:
    return json.loads(authz.cli("status", "--json").stdout)


def test_a_worker_is_placed_by_the_authorizer_admitted_and_then_serves(tmp_path):
    with authorized_run(tmp_path, "adm-serve", lifetime_s=6.0) as (authz, observer):
        with admitted_worker(tmp_path, authz, observer) as worker:
            assert worker.stage in (0, 1)
            info = observer.call(worker.address, "worker.info").meta
            credential = info["credential"]
            assert info["stage"] == worker.stage and credential["valid"] and credential["lost"] is None
            assert credential["stage"] == worker.stage and credential["serial"] is not None
            announced = observer.get(stage_workers_key("adm-serve", worker.stage))
            assert [v.value["node_id"] for v in announced.values()] == [worker.node_id]
            tokens = np.arange(8, dtype=np.int64).reshape(1, 8)
            boundary = np.zeros((1, 8, 4), dtype=np.float32)
            tensors = (
                {"tokens": tokens}
                if worker.stage == 0
                else {"tokens": tokens, "boundary": boundary, "labels": tokens}
            )
            reply = observer.call(worker.address, "forward", {"stage": worker.stage}, tensors)
            assert ("boundary" if worker.stage == 0 else "loss") in reply.tensors
            admitted = status(authz)["admitted"]
            assert admitted["workers_per_stage"] == {str(worker.stage): 1}
            # it keeps its credential fresh: a 6 s credential is refreshed at 4 s
            wait_until(
                lambda: observer.call(worker.address, "worker.info").meta["credential"]["refreshes"] >= 1,
                timeout_s=15,
                what="a credential refresh",
                every_s=0.2,
            )


def departure(observer: RunObserver, run_name: str, worker: Admitted) -> WorkerDeparture:
    found = observer.get(stage_departures_key(run_name, worker.stage))
    mine = [d for d in parse_entries(found, WorkerDeparture.from_value) if d.node_id == worker.node_id]
    assert len(mine) == 1, found
    return mine[0]


def stops_for_credential_lost(worker: Admitted, within_s: float) -> str:
    """The worker says it terminated for credential_lost within ``within_s`` and exits with its
    code; the detail."""
    started = time.monotonic()
    line = worker.child.read_until("terminated: ", timeout_s=within_s)
    code = EXIT_CODES[DepartureReason.CREDENTIAL_LOST]
    assert line.startswith(f"credential_lost (exit code {code})"), line
    assert worker.child.proc.wait(timeout=30) == code
    assert time.monotonic() - started <= within_s
    return line


def test_a_worker_whose_refresh_is_refused_stops_serving_within_one_refresh_and_exits(tmp_path):
    lifetime_s = 6.0
    # the authorizer in a DHT of its own: only the refused refresh can tell the worker
    with authorized_run(tmp_path, "adm-refused", lifetime_s=lifetime_s, authorizer_in_dht=False) as (
        authz,
        observer,
    ):
        with admitted_worker(tmp_path, authz, observer) as worker:
            assert "banned node" in authz.cli("ban", worker.node_id, "--kind", "node").stdout
            banned_at = time.monotonic()
            line = stops_for_credential_lost(worker, within_s=lifetime_s + 5.0)
            assert "on the run's revocation list" not in line, line  # it was the refresh
            assert time.monotonic() - banned_at <= lifetime_s + 5.0
            assert departure(observer, "adm-refused", worker).reason is DepartureReason.CREDENTIAL_LOST
            assert observer.get(stage_workers_key("adm-refused", worker.stage)) == {}  # withdrawn


def test_a_worker_on_the_dht_revocation_list_stops_before_its_credential_expires(tmp_path):
    # a credential of ten minutes: only the revocation list the authorizer publishes can stop it soon
    with authorized_run(tmp_path, "adm-revoked", lifetime_s=600.0) as (authz, observer):
        with admitted_worker(tmp_path, authz, observer) as worker:
            authz.cli("ban", worker.node_id, "--kind", "node")
            line = stops_for_credential_lost(worker, within_s=15.0)
            assert "on the run's revocation list" in line, line
            assert departure(observer, "adm-revoked", worker).reason is DepartureReason.CREDENTIAL_LOST


def worker_cli(tmp_path, admission: str, *flags: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.toml"
    config.write_text(run_toml("cli", admission))
    command = [
        sys.executable,
        "-m",
        "agora_worker",
        "run",
        "--config",
        str(config),
        "--key-file",
        str(tmp_path / "k"),
    ]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=CLI_S)


AUTHORIZED = f'mode = "authorized"\nauthorizer_public_key = "{KEY}"'


@pytest.mark.parametrize(
    ("admission", "flags", "says"),
    [
        # the authorizer places workers: --stage is not the worker's to choose
        (AUTHORIZED, ("--authorizer", "127.0.0.1:9", "--stage", "1"), "agora-authorizer pin"),
        # an open run has nobody to place it
        ('mode = "open"', (), "--stage is required"),
        # the run config is the contract: an authorized run needs an authorizer, an open one has none
        (AUTHORIZED, (), "--authorizer HOST:PORT"),
        ('mode = "open"', ("--stage", "0", "--authorizer", "127.0.0.1:9"), "an open run has no authorizer"),
    ],
)
def test_the_command_line_refuses_a_stage_or_an_authorizer_the_run_config_does_not_call_for(
    tmp_path, admission, flags, says
):
    done = worker_cli(tmp_path, admission, *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr
