"""A trainer in an authorized run, against a real authorizer process (its own SQLite file, a
free 127.0.0.1 port): admitted before it routes anything, stopped with the credential_lost
exit code when its refresh is refused, and dropping workers the run's revocation list names.
No torch: the compute challenge runs on numpy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agora_core.admission.node_admission import CREDENTIAL_LOST_EXIT_CODE, cpu_hardware
from agora_core.config import NodeSettings, parse_run_config
from agora_core.contract import Phase
from agora_core.dht import owned_subkey
from agora_core.identity import NodeKey
from agora_core.node.role import RoleNode
from agora_core.schema import WorkerAnnouncement, stage_workers_key
from agora_devkit.authorizer import (
    OPEN_FLOORS,
    AuthorizerProcess,
    RunObserver,
    authorizer_process,
    write_run,
)
from agora_devkit.processes import ChildProcess, spawn_python, wait_until_async
from agora_devkit.runs import tiny_run_toml
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

pytestmark = pytest.mark.slow
START_S = 60.0  # a trainer process starts and is admitted


def run_toml(name: str, lifetime_s: float) -> str:
    """The admission tests' run: open floors, credentials of ``lifetime_s``."""
    return tiny_run_toml(
        name,
        stages=2,
        seq_len=16,
        dht={"suspicion_timeout_s": 1.0, "op_timeout_s": 1.0, "record_ttl_s": 3.0},
        averaging={"matchmaking_window_s": 1.0, "round_timeout_s": 5.0, "chunk_timeout_s": 2.0},
        extra=f"[admission]\n{OPEN_FLOORS}credential_lifetime_s = {lifetime_s}",
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    make_shards(out, shards=1, tokenizer=ByteTokenizer(), max_bytes=20_000)
    return out


@contextlib.contextmanager
def authorizer(tmp_path: Path, name: str, *, lifetime_s: float, key: NodeKey | None = None, seed: str = ""):
    """An authorizer of run ``name`` (with ``key``, if given), in its own DHT or, with ``seed``
    (a ``<hex key>@address``), in that member's."""
    run = parse_run_config(run_toml(name, lifetime_s))
    extra = ("--allow-local-build",) + (("--bootstrap", seed) if seed else ())
    with authorizer_process(tmp_path / "authz", run, key=key, extra=extra) as process:
        yield process


@contextlib.contextmanager
def trainer_process(
    tmp_path: Path, authz: AuthorizerProcess, shards: Path
) -> Iterator[tuple[ChildProcess, str]]:
    """A trainer process admitted through ``authz`` (alone in its DHT: it waits for workers)."""
    token = authz.add_account("acme")
    command = [
        *("-m", "agora_trainer", "run", "--config", str(authz.config_file), "--shards", str(shards)),
        *("--authorizer", authz.address, "--account", "acme", "--key-file", str(tmp_path / "trainer.key")),
        *("--progress-interval", "0.5", "--refresh-interval", "0.3"),
    ]
    with spawn_python(command, env={"AGORA_ACCOUNT_TOKEN": token, "AGORA_LOG_LEVEL": "warning"}) as child:
        node_id = child.read_until("  node id    ", timeout_s=START_S)
        admitted = ""
        while not admitted.startswith("admitted"):  # queued first, maybe
            admitted = child.read_until("  admission  ", timeout_s=START_S)
        yield child, node_id


def test_a_trainer_is_admitted_before_it_trains_and_stops_cleanly(tmp_path, shards):
    with authorizer(tmp_path, "adm-trainer", lifetime_s=60.0) as authz:
        with trainer_process(tmp_path, authz, shards) as (child, node_id):
            report = json.loads(authz.cli("status", "--json").stdout)
            assert report["admitted"]["by_role"] == {"trainer": 1}
            assert [n["node_id"] for n in report["nodes"]] == [node_id]
            child.proc.send_signal(signal.SIGTERM)  # still waiting for workers: nothing in flight
            assert child.read_until("stopped before training", timeout_s=30) == ""
            assert child.proc.wait(timeout=30) == 0


def test_a_trainer_whose_refresh_is_refused_stops_with_the_credential_lost_code(tmp_path, shards):
    lifetime_s = 6.0
    with authorizer(tmp_path, "adm-trainer-ban", lifetime_s=lifetime_s) as authz:
        with trainer_process(tmp_path, authz, shards) as (child, node_id):
            authz.cli("ban", node_id, "--kind", "node")
            started = time.monotonic()
            line = child.read_until("credential lost ", timeout_s=lifetime_s + 5.0)
            assert f"(exit code {CREDENTIAL_LOST_EXIT_CODE})" in line, line
            assert child.proc.wait(timeout=30) == CREDENTIAL_LOST_EXIT_CODE
            assert time.monotonic() - started <= lifetime_s + 5.0


async def test_a_trainer_drops_workers_on_the_revocation_list_from_its_routing(tmp_path, shards):
    # the test's own credentialed member of the run's DHT (the seed the authorizer and the
    # trainer join through), where the workers' announcements are stored
    authorizer_key = NodeKey.generate()
    name = "adm-routing"
    run = parse_run_config(run_toml(name, 60.0))
    run, _ = write_run(tmp_path, run, authorizer_key)
    authz_stack = contextlib.ExitStack()
    seed = await asyncio.to_thread(authz_stack.enter_context, RunObserver(run, authorizer_key, role="dht"))
    try:
        authz = await asyncio.to_thread(
            authz_stack.enter_context,
            authorizer(tmp_path, name, lifetime_s=60.0, key=authorizer_key, seed=seed.peer),
        )
        token = await asyncio.to_thread(authz.add_account, "acme")
        run, key = authz.run, NodeKey.generate()
        member = RoleNode.build("trainer", run, key, bootstrap=[seed.peer], authorizer=authz.address)
        settings = NodeSettings(authorizer=authz.address, account="acme", account_token=token)
        admission = member.ask_authorizer(settings, cpu_hardware())
        trainer = Trainer(
            run=run,
            shards_dir=shards,
            key=key,
            settings=TrainerSettings(refresh_interval_s=0.3, progress_interval_s=0.5),
            member=member,
        )
        try:
            # One worker per stage, each a credentialed member announcing itself the way workers
            # do (signed, under its own key); the trainer routes to both, until one is banned.
            members = [
                await asyncio.to_thread(
                    authz_stack.enter_context,
                    RunObserver(run, authorizer_key, role="worker", stage=stage, bootstrap=[seed.peer]),
                )
                for stage in range(2)
            ]
            workers = [member.key for member in members]
            for stage, (worker, member) in enumerate(zip(workers, members, strict=True)):
                announcement = WorkerAnnouncement(
                    node_id=worker.node_id,
                    address=f"tcp://127.0.0.1:{9 + stage}",
                    stage=stage,
                    phase=Phase.SERVING,
                    throughput=1.0,
                    load=0,
                    max_batch=1,
                    version="test",
                )
                await asyncio.to_thread(
                    member.store,
                    stage_workers_key(run.name, stage),
                    owned_subkey(worker.public_key),
                    announcement.to_value(),
                    time.time() + 60,
                    signer=worker,
                )
            await admission.submit()
            await trainer.start()  # admitted, and both stages have a worker
            assert admission.valid and [len(b.workers) for b in trainer.balancers] == [1, 1]
            await asyncio.to_thread(authz.cli, "ban", workers[1].node_id, "--kind", "node")
            await wait_until_async(
                lambda: [len(b.workers) for b in trainer.balancers] == [1, 0],
                timeout_s=15,
                what="the banned worker to leave the trainer's routing",
            )
            assert trainer.revoked == {workers[1].node_id} and admission.lost is None
        finally:
            await trainer.close()
    finally:
        await asyncio.to_thread(authz_stack.close)
