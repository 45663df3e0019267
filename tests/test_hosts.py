"""An authorized run across two hosts, started by hand through the plain CLIs.

The hosts are two network namespaces joined by a veth pair (``agora_devkit.hosts``):
each node listens on its host's own address and advertises it, and every connection between
them crosses the veth, as between two machines. Host A runs the DHT seed (an operator's
``dht`` credential), the authorizer and one worker per stage; host B runs the other replica
of each stage and the trainer. No ``tools/swarm.py``: the commands are the ones an operator
and contributors type. Once B's replicas have averaged with their peers on A, the operator,
from host B, tells A's stage-1 replica through the DHT (``tools/inject.py``, signed with an
operator credential) to crash mid forward: it dies with the injection's exit code, and the
trainer trains a few hundred more samples on the replica left, the loss falling, until the
test stops it (Ctrl-C's clean stop: the trainer never runs out of samples before the crash,
however slow the machine).
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agora_authorizer.cli_credential import issue_operator_credential
from agora_authorizer.store import Store
from agora_core.admission.credential_file import save_credential
from agora_core.config import load_run_config
from agora_core.identity import NodeKey
from agora_devkit.hosts import Host, HostsUnavailable, two_hosts
from agora_devkit.processes import wait_until

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 320  # trained after the crash, on the surviving replica
EPOCHS = 20  # an upper bound the test never reaches: it stops the trainer itself
EXIT_CODE = 97  # the injected crash's, told apart from any other exit
START_S = 120.0  # every node serving (torch imports on a busy two-core machine)
TRAIN_S = 150.0
SERVING = re.compile(r"^  serving    (\S+)", re.M)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGORA_LOG_FORMAT": "console"}
EDITS = {"stage_layers": "stage_layers = [1, 1]", "weight_sync_steps": "weight_sync_steps = 10"}


def _run_config(tmp: Path, authorizer_public_key: str) -> Path:
    text = (ROOT / "examples" / "tiny.toml").read_text()
    lines = [next((v for k, v in EDITS.items() if line.startswith(k)), line) for line in text.splitlines()]
    at = lines.index("[admission]") + 1
    lines[at:at] = ['mode = "authorized"', f'authorizer_public_key = "{authorizer_public_key}"']
    path = tmp / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _shards(tmp: Path) -> Path:
    out = tmp / "shards"
    command = [
        sys.executable,
        str(ROOT / "tools" / "make_shards.py"),
        str(out),
        "--shards",
        "2",
        "--max-mb",
        "0.5",
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return out


def _serving(host: Host, proc: subprocess.Popen, log: Path) -> str:
    """The address a node started on ``host`` serves at, once its log says so."""
    found: list[str] = []

    def serving() -> bool:
        assert proc.poll() is None, f"{log.name} exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        found[:] = SERVING.findall(log.read_text(errors="replace"))
        return bool(found)

    wait_until(serving, timeout_s=START_S, every_s=0.2, what=f"{log.name} serving")
    assert host.address in found[0], f"{log.name} advertises {found[0]}, not its host's {host.address}"
    return found[0]


def _lines(log: Path, event: str) -> list[dict[str, str]]:
    """The key=value fields of each console log line of ``event`` in ``log``."""
    rows = []
    for line in log.read_text(errors="replace").splitlines():
        if f" {event} " in line:
            rows.append(dict(re.findall(r"(\w+)=(\S+)", line)))
    return rows


def _averaged(log: Path) -> bool:
    """Whether the worker of ``log`` finished an averaging round with its stage's other replica."""
    rounds = _lines(log, "averaging_round")
    return any(r["group_size"] == "2" and float(r["averaging_success"]) > 0 for r in rounds)


@pytest.mark.timeout(START_S + TRAIN_S + 120, func_only=True)
def test_an_authorized_run_trains_across_two_hosts(tmp_path):
    keys, logs = tmp_path / "keys", tmp_path / "logs"
    keys.mkdir()
    logs.mkdir()
    # the operator's side, done here (no node in it): the authorizer's key, the run config
    # naming it, an account, offline credentials for the seed and for tools/inject.py, pins
    authorizer_key = keys / "authorizer.key"
    authorizer = NodeKey.load_or_create(authorizer_key)
    config, db = str(_run_config(tmp_path, authorizer.public_key.hex())), str(tmp_path / "authorizer.db")
    workers = [(stage, host_index, keys / f"worker-{stage}-{host_index}.key") for stage in (0, 1) for host_index in (0, 1)]  # fmt: skip
    token = secrets.token_urlsafe(16)
    with Store.open(db) as store:
        store.add_account("lab", token, now=time.time())
        for role in ("dht", "operator"):
            credential = issue_operator_credential(store, run=load_run_config(config), authorizer=authorizer,
                                                   node=NodeKey.load_or_create(keys / f"{role}.key"), role=role,
                                                   stage=None, lifetime_s=3600.0)  # fmt: skip
            save_credential(credential, keys / f"{role}.credential")
        for (
            stage,
            _,
            key_file,
        ) in workers:  # one replica of each stage per host: the test knows which is where
            store.pin(NodeKey.load_or_create(key_file).node_id, stage, now=time.time())
    seed_key = NodeKey.load(keys / "dht.key")
    shards = _shards(tmp_path)
    hosts = contextlib.ExitStack()
    try:
        a, b = hosts.enter_context(two_hosts())
    except HostsUnavailable as exc:
        pytest.skip(f"cannot make two hosts on this machine: {exc}")
    with hosts:  # on exit, every process on either host stopped and both namespaces gone
        listen = lambda host: ["--listen", f"{host.address}:0"]  # noqa: E731 (advertised as bound)
        seed_log = logs / "dht.log"
        seed = a.spawn(["-m", "agora_core", "dht", "serve", "--config", config, *listen(a), "--key-file",
                        str(keys / "dht.key"), "--credential", str(keys / "dht.credential")], seed_log, CHILD_ENV)  # fmt: skip
        bootstrap = f"{seed_key.public_key.hex()}@{_serving(a, seed, seed_log)}"
        auth_log = logs / "authorizer.log"
        auth = a.spawn(["-m", "agora_authorizer", "serve", "--config", config, "--db", db, "--key-file",
                        str(authorizer_key), *listen(a), "--bootstrap", bootstrap, "--allow-local-build"], auth_log, CHILD_ENV)  # fmt: skip
        node_env = {**CHILD_ENV, "AGORA_ACCOUNT_TOKEN": token}
        joined = ["--authorizer", _serving(a, auth, auth_log), "--account", "lab", "--bootstrap", bootstrap]
        started = []
        for _, host_index, key_file in workers:
            host = (a, b)[host_index]
            log = logs / f"{key_file.stem}.log"
            proc = host.spawn(["-m", "agora_worker", "run", "--config", config, *listen(host), *joined,
                               "--key-file", str(key_file), "--device", "cpu", "--progress-interval", "0.1"], log, node_env)  # fmt: skip
            started.append((host, proc, log))
        for host, proc, log in started:
            _serving(host, proc, log)
        trainer_log = logs / "trainer.log"
        trainer = b.spawn(["-m", "agora_trainer", "run", "--config", config, *listen(b), *joined, "--shards",
                           str(shards), "--key-file", str(keys / "trainer.key"), "--lanes", "4", "--epochs",
                           str(EPOCHS), "--loss-log", str(tmp_path / "losses.jsonl"), "--status-interval", "5"],
                          trainer_log, node_env)  # fmt: skip
        b_logs = [log for host, _, log in started if host is b]

        def b_averaged_across() -> bool:
            assert trainer.poll() is None, f"trainer exited early:\n{trainer_log.read_text()[-3000:]}"
            return all(_averaged(log) for log in b_logs)

        wait_until(b_averaged_across, timeout_s=START_S + TRAIN_S / 2, every_s=0.5,
                   what="B's replicas averaging with their peers on A")  # fmt: skip
        # the operator, on host B, crashes A's stage-1 replica mid forward through the DHT
        victim_host, victim, victim_log = started[2]
        assert victim_host is a and workers[2][:2] == (1, 0)
        inject_log = logs / "inject.log"
        tool = b.spawn([str(ROOT / "tools" / "inject.py"), "--bootstrap", bootstrap, "--config", config,
                        "--key", str(keys / "operator.key"), "--credential", str(keys / "operator.credential"),
                        "add", "--action", "exit", "--trigger", "forward", "--exit-code", str(EXIT_CODE),
                        "--node", NodeKey.load(workers[2][2]).node_id], inject_log, CHILD_ENV)  # fmt: skip
        assert tool.wait(timeout=60) == 0, inject_log.read_text()
        wait_until(lambda: victim.poll() is not None, timeout_s=30, what="the injected crash")
        assert victim.returncode == EXIT_CODE, f"{victim_log.name} exited {victim.returncode}"
        assert "injection_obeyed" in victim_log.read_text(errors="replace")
        loss_log = tmp_path / "losses.jsonl"
        at_crash = len(loss_log.read_text().splitlines()) if loss_log.exists() else 0

        def trained_past_the_crash() -> bool:
            assert trainer.poll() is None, (
                f"trainer exited ({trainer.poll()}):\n{trainer_log.read_text()[-3000:]}"
            )
            return len(loss_log.read_text().splitlines()) >= at_crash + SAMPLES

        wait_until(
            trained_past_the_crash, timeout_s=TRAIN_S, every_s=0.5, what=f"{SAMPLES} samples after the crash"
        )
        trainer.send_signal(signal.SIGINT)  # its clean stop: lanes finish their samples
        with contextlib.suppress(subprocess.TimeoutExpired):  # the assert below says how it ended
            trainer.wait(timeout=60)
        assert trainer.poll() == 0, f"trainer: {trainer.poll()}\n{trainer_log.read_text()[-3000:]}"
        survivors = [proc for _, proc, _ in started if proc is not victim]
        assert all(proc.poll() is None for proc in survivors), "a worker the injection spared exited"
        losses = [json.loads(line)["loss"] for line in loss_log.read_text().splitlines()]
        assert len(losses) >= at_crash + SAMPLES
        head, tail = sum(losses[:32]) / 32, sum(losses[-32:]) / 32
        assert tail < head, f"loss did not fall: {head:.3f} -> {tail:.3f}"
        for _, _, log in started:  # every replica, on either host, served samples
            steps = _lines(log, "optimizer_step")
            assert sum(int(step["samples"]) for step in steps) > 0, f"{log.name} served no sample"
