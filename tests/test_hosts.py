"""An authorized run across two hosts, started by hand through the plain CLIs.

The hosts are two network namespaces joined by a veth pair (``agora_core.testing_hosts``):
each node listens on its host's own address and advertises it, and every connection between
them crosses the veth, as between two machines. Host A runs the DHT seed (an operator's
``dht`` credential), the authorizer and one worker per stage; host B runs the other replica
of each stage and the trainer. No ``tools/swarm.py``: the commands are the ones an operator
and contributors type. The run trains a few hundred samples; each worker must have served
samples and the replicas on B must have averaged with their peers on A.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agora_core.identity import NodeKey
from agora_core.testing import wait_until
from agora_core.testing_hosts import Host, HostsUnavailable, two_hosts

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SAMPLES = 256
START_S = 120.0  # every node serving (torch imports on a busy two-core machine)
TRAIN_S = 150.0
SERVING = re.compile(r"^  serving    (\S+)", re.M)
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "AGORA_LOG_FORMAT": "console"}
EDITS = {"stage_layers": "stage_layers = [1, 1]", "weight_sync_steps": "weight_sync_steps = 10"}


def _cli(*args: str) -> str:
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{' '.join(args[:3])}: {done.stderr or done.stdout}"
    return done.stdout


def _after(output: str, prefix: str) -> str:
    return next(line[len(prefix) :].strip() for line in output.splitlines() if line.startswith(prefix))


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
    _cli(str(ROOT / "tools" / "make_shards.py"), str(out), "--shards", "2", "--max-mb", "0.5")
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


@pytest.mark.timeout(START_S + TRAIN_S + 120, func_only=True)
def test_an_authorized_run_trains_across_two_hosts(tmp_path):
    keys, logs = tmp_path / "keys", tmp_path / "logs"
    keys.mkdir()
    logs.mkdir()
    # the operator: an authorizer key, the run config naming it, an account, the seed's credential
    authorizer_key = str(keys / "authorizer.key")
    public_key = _after(_cli("-m", "agora_authorizer", "keygen", "--key-file", authorizer_key), "public key ")
    config, db = str(_run_config(tmp_path, public_key)), str(tmp_path / "authorizer.db")
    token = _after(_cli("-m", "agora_authorizer", "account", "add", "lab", "--db", db), "token ")
    seed_key = NodeKey.load_or_create(keys / "dht.key")
    _cli("-m", "agora_authorizer", "credential", "--config", config, "--db", db, "--key-file", authorizer_key,
         "--node-key", str(keys / "dht.key"), "--role", "dht", "--out", str(keys / "dht.credential"))  # fmt: skip
    # one replica of each stage per host, pinned so the test knows which is where
    workers = [(stage, host_index, keys / f"worker-{stage}-{host_index}.key") for stage in (0, 1) for host_index in (0, 1)]  # fmt: skip
    for stage, _, key_file in workers:
        _cli(
            "-m", "agora_authorizer", "pin", NodeKey.load_or_create(key_file).node_id, str(stage), "--db", db
        )
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
                        authorizer_key, *listen(a), "--bootstrap", bootstrap, "--allow-local-build"], auth_log, CHILD_ENV)  # fmt: skip
        authorizer = _serving(a, auth, auth_log)
        node_env = {**CHILD_ENV, "AGORA_ACCOUNT_TOKEN": token}
        joined = ["--authorizer", authorizer, "--account", "lab", "--bootstrap", bootstrap]
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
                           str(shards), "--key-file", str(keys / "trainer.key"), "--lanes", "4", "--max-samples",
                           str(SAMPLES), "--loss-log", str(tmp_path / "losses.jsonl"), "--status-interval", "5"],
                          trainer_log, node_env)  # fmt: skip
        deadline = time.monotonic() + START_S + TRAIN_S
        while trainer.poll() is None and time.monotonic() < deadline:
            assert all(proc.poll() is None for _, proc, _ in started), "a worker exited mid-run"
            time.sleep(0.5)  # another process's progress: polled with a deadline
        assert trainer.poll() == 0, f"trainer: {trainer.poll()}\n{trainer_log.read_text()[-3000:]}"
        losses = [json.loads(line)["loss"] for line in (tmp_path / "losses.jsonl").read_text().splitlines()]
        assert len(losses) >= SAMPLES
        head, tail = sum(losses[:32]) / 32, sum(losses[-32:]) / 32
        assert tail < head, f"loss did not fall: {head:.3f} -> {tail:.3f}"
        for _, _, log in started:  # every replica, on either host, served samples
            steps = _lines(log, "optimizer_step")
            assert sum(int(step["samples"]) for step in steps) > 0, f"{log.name} served no sample"
        for _, host_index, key_file in workers:  # B's replicas averaged with their peers on A
            if host_index == 1:
                rounds = _lines(logs / f"{key_file.stem}.log", "averaging_round")
                averaged = [r for r in rounds if r["group_size"] == "2" and float(r["averaging_success"]) > 0]
                assert averaged, f"{key_file.stem} never averaged with its peer across the hosts: {rounds}"
