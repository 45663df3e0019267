"""Helpers for tests and benchmarks of the authorizer: a real authorizer process, and joiners.

:func:`authorizer_process` starts ``python -m agora_authorizer serve`` on a run config it
writes (open floors, the key it creates) and stops it when the block ends. :class:`TestJoiner`
is a node that asks to join: its own key, RPC server (serving the dial-back) and client, all
on 127.0.0.1. :class:`RunObserver` is a test's own member of an authorized run's DHT (a seed
the test reads, and a client that calls the run's nodes), credentialed with the authorizer's
key directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from agora_core.admission import HardwareReport, JoinRequest
from agora_core.admission.answerer import DialBackAnswerer
from agora_core.admission.credential import SignedCredential
from agora_core.admission.credential_file import load_credential
from agora_core.admission.join_client import Admission, JoinStatus
from agora_core.admission.keeper import CredentialKeeper
from agora_core.config import RunConfig, parse_run_config
from agora_core.config.dump import dump_toml
from agora_core.dht import BlockingDht
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode, transport_security
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import ChildProcess, spawn_python

# [admission] floors any test machine passes, and no rate limit (tests of other roles put
# these lines in their own run configs)
OPEN_FLOORS = """min_device_memory_gb = 0.0
min_host_memory_gb = 0.0
min_bandwidth_mbps = 0.0
max_latency_ms = 0.0
max_challenge_s = 0.0
bandwidth_probe_bytes = 65536
admissions_per_minute = 0.0
"""
# A small run with those floors.
TEST_RUN = (
    """
name = "authz-test"
[model]
kind = "surrogate"
d_model = 64
n_heads = 4
stage_layers = [1, 1]
[admission]
"""
    + OPEN_FLOORS
)
GB = 10**9


def small_run(**admission) -> RunConfig:
    run = parse_run_config(TEST_RUN)
    return dataclasses.replace(run, admission=dataclasses.replace(run.admission, **admission))


@dataclass
class AuthorizerProcess:
    child: ChildProcess
    address: str
    run: RunConfig
    key: NodeKey
    db: str
    key_file: Path
    config_file: Path

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """Run an ``agora-authorizer`` command on this authorizer's database."""
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "agora_authorizer",
                *args,
                "--db",
                self.db,
                "--key-file",
                str(self.key_file),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"agora-authorizer {' '.join(args)} failed: {result.stderr or result.stdout}")
        return result

    def operator_credential(self, key_file: Path, role: str = "monitor") -> SignedCredential:
        """Issue (``agora-authorizer credential``) and load the credential of the key in
        ``key_file`` (created if missing) for ``role``."""
        out = key_file.with_suffix(".credential")
        self.cli(
            "credential",
            *("--config", str(self.config_file), "--node-key", str(key_file)),
            *("--role", role, "--out", str(out)),
        )
        return load_credential(
            out,
            authorizer_public_key=self.key.public_key,
            run=self.run.name,
            public_key=NodeKey.load(key_file).public_key,
        )

    def operator_node(self, key_file: Path, role: str = "monitor") -> RunNode:
        """A RunNode of this run holding an operator credential of ``role`` (not started);
        it joins the DHT through the authorizer."""
        credential = self.operator_credential(key_file, role)
        return RunNode(
            run=self.run,
            key=NodeKey.load(key_file),
            metrics=NodeMetrics(role=role),
            authorizer=self.address,
            credential=credential,
        )

    def add_account(self, name: str, *, max_nodes: int | None = None) -> str:
        args = ["account", "add", name] + ([] if max_nodes is None else ["--max-nodes", str(max_nodes)])
        return self.cli(*args).stdout.split()[-1]


def write_run(directory: Path, run: RunConfig, key: NodeKey) -> tuple[RunConfig, Path]:
    """The run with mode "authorized" and ``key``'s public key, written to directory/run.toml."""
    admission = dataclasses.replace(
        run.admission, mode="authorized", authorizer_public_key=key.public_key.hex()
    )
    run = dataclasses.replace(run, admission=admission)
    path = directory / "run.toml"
    path.write_text(dump_toml(run))
    return run, path


@contextlib.contextmanager
def authorizer_process(
    directory: Path,
    run: RunConfig | None = None,
    *,
    db: str | None = None,
    key: NodeKey | None = None,
    extra: tuple[str, ...] = (),
    start_timeout_s: float = 60.0,
) -> Iterator[AuthorizerProcess]:
    """A running authorizer (stopped when the block exits); ``db`` defaults to a SQLite file
    in ``directory``. The same ``directory``, ``db`` and ``key`` restart the same authorizer."""
    directory.mkdir(parents=True, exist_ok=True)
    key_file = directory / "authorizer.key"
    if key is None:
        key = NodeKey.load_or_create(key_file)
    elif not key_file.exists():
        key.save(key_file)
    run, config_file = write_run(directory, run or small_run(), key)
    db = db or str(directory / "authorizer.db")
    args = ["-m", "agora_authorizer", "serve", "--config", str(config_file), "--db", db]
    args += ["--key-file", str(key_file), "--log-format", "json", *extra]
    with spawn_python(args, env={"PYTHONUNBUFFERED": "1"}) as child:
        address = child.read_until("  serving    ", timeout_s=start_timeout_s)
        yield AuthorizerProcess(child, address, run, key, db, key_file, config_file)


def signed_credential(
    authorizer: NodeKey,
    run: RunConfig,
    node: NodeKey,
    *,
    role: str = "operator",
    stage: int | None = None,
    lifetime_s: float = 3600.0,
) -> SignedCredential:
    """A credential of ``run`` for ``node`` (``role``, on ``stage``), signed with the
    authorizer's key directly, the way ``agora-authorizer credential`` issues one (for a
    test's own nodes; serials far from the authorizer's own, which count from 1)."""
    authority = TestAuthority(run.name, authorizer)
    return authority.credential(node, role=role, stage=stage, lifetime_s=lifetime_s, account="operator")


class RunObserver(BlockingDht):
    """A test's member of authorized ``run``'s DHT: a seed others bootstrap through
    (:attr:`peer`), read with BlockingDht's methods, and a client that calls the run's nodes
    (:meth:`call`) holding an operator credential signed by ``authorizer``."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        run: RunConfig,
        authorizer: NodeKey,
        *,
        role: str = "operator",
        stage: int | None = None,
        bootstrap: Sequence[str] = (),
        timeout_s: float = 10.0,
    ):
        self.key = NodeKey.generate()
        node = {
            "run": run,
            "key": self.key,
            "metrics": NodeMetrics(role="test"),
            "bootstrap": list(bootstrap),
            "credential": signed_credential(authorizer, run, self.key, role=role, stage=stage),
        }
        super().__init__(timeout_s=timeout_s, run_node=node)

    @property
    def peer(self) -> str:
        """This node's bootstrap address in an authorized run: ``<hex key>@tcp://host:port``."""
        return f"{self.key.public_key.hex()}@{self.address}"

    def call(
        self,
        address: str,
        method: str,
        meta: dict | None = None,
        tensors: dict | None = None,
        *,
        timeout_s: float = 5.0,
    ) -> Payload:
        """An authenticated call from this node (``address`` must be a member it knows)."""
        call = self.client.call(address, method, meta or {}, tensors or {}, timeout_s=timeout_s)
        return self.submit(call, timeout_s + 5.0)

    def knows(self, address: str) -> bool:
        """Whether ``address`` is a live member in this node's table (so its key is known)."""
        return any(m.address == address for m in self.members())

    def __enter__(self) -> RunObserver:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self


class TestJoiner:
    """A node that asks ``authorizer`` to admit it: serves the dial-back on 127.0.0.1."""

    __test__ = False  # not a pytest class

    def __init__(self, run: RunConfig, authorizer: str, *, key: NodeKey | None = None, role: str = "worker"):
        self.run = run
        self.authorizer = authorizer
        self.key = key or NodeKey.generate()
        self.role = role
        # an authorized run's transport: the authorizer dials this key back, we dial its key
        self.security = transport_security(run, self.key)
        if self.security is not None:
            self.security.expect(authorizer, run.admission.authorizer_key_bytes, credentialed=False)
        self.server = RpcServer(listen="127.0.0.1:0", security=self.security)
        self.client = RpcClient(security=self.security)
        self.answerer = DialBackAnswerer(self.key, run.name)
        self.answerer.register(self.server)
        self.address = ""
        assert run.admission.authorizer_key_bytes is not None
        self.admission = Admission(
            client=self.client,
            authorizer=authorizer,
            key=self.key,
            authorizer_key=run.admission.authorizer_key_bytes,
            run=run.name,
        )

    def use_authorizer(self, address: str) -> None:
        """Ask the authorizer at ``address`` from now on (a restarted one)."""
        self.authorizer = self.admission.authorizer = address
        if self.security is not None:
            self.security.expect(address, self.run.admission.authorizer_key_bytes, credentialed=False)

    async def start(self) -> TestJoiner:
        self.address = await self.server.start()
        return self

    async def close(self) -> None:
        await self.server.stop()
        await self.client.close()

    def request(self, account: str, token: str, **overrides) -> JoinRequest:
        fields = {
            "run": self.run.name,
            "node_id": self.key.node_id,
            "public_key": self.key.public_key,
            "role": self.role,
            "address": self.address,
            "account": account,
            "account_token": token,
            "hardware": HardwareReport(
                device="cpu",
                device_memory_bytes=32 * GB,
                host_memory_bytes=os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                cpu_count=os.cpu_count() or 1,
            ),
            "software": _core_software(),
        }
        return JoinRequest(**{**fields, **overrides})

    def keeper(self, credential: SignedCredential) -> CredentialKeeper:
        """A keeper of ``credential`` (its refresh() asks the authorizer for the next one)."""
        return CredentialKeeper(
            client=self.client,
            authorizer=self.authorizer,
            key=self.key,
            authorizer_key=self.admission.authorizer_key,
            run=self.run.name,
            credential=credential,
            on_lost=lambda reason, detail: None,
        )

    async def join(self, account: str, token: str, **overrides) -> JoinStatus:
        return await self.admission.submit(self.request(account, token, **overrides))


def _core_software() -> dict[str, dict[str, str]]:
    """What a test joiner reports: agora-core's real version and digest (the package every
    role has; the worker and trainer packages need not be importable in the authorizer's tests)."""
    from agora_core.admission.software import package_report

    return {"agora-core": package_report("agora_core")}
