"""An authorized simulated swarm: the run's own authorizer admits every worker and trainer.

``[swarm] authorized = true`` runs the swarm as ``tools/swarm.py up`` runs one (without
``--open``): the run config names an authorizer key drawn from the seed; an
``agora_authorizer`` :class:`~agora_authorizer.service.Authorizer` serves on a host of its own,
its database a SQLite file in the scratch folder with one account; the DHT seed and the
stageless members hold long-lived credentials signed offline, as ``agora-authorizer
credential`` signs them. Each worker is pinned to the scenario's stage (``agora-authorizer
pin``), binds its port, answers the dial-back (the round trip, the bandwidth probe and the
compute challenge cross the simulated links), waits in the queue, and takes its credential, as
``agora-worker run`` does; each trainer joins the same way, and a restarted one joins again.
Every connection is CURVE (``agora_sim.curve``), every method checked against the
caller's credential, every credential refreshed before it expires.

The run relaxes the capability floors (a scenario's links and speeds say what a node has, not
a contributor's GPU) and issues credentials for ``SIM_CREDENTIAL_S``, so they are refreshed
within a run, through its partitions and silences.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from agora_authorizer.cli_credential import issue_operator_credential
from agora_authorizer.service import Authorizer
from agora_authorizer.store import Store
from agora_core import world
from agora_core.admission.join_request import HardwareReport
from agora_core.config import NodeSettings, RunConfig
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.node.role import RoleNode
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_trainer.trainer import Trainer, TrainerSettings
from agora_worker.admission import device_matmul
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

if TYPE_CHECKING:
    from agora_sim.swarm import _Swarm

ACCOUNT = "sim"  # the one contributor account every node joins under
SIM_CREDENTIAL_S = 90.0  # refreshed at 60 s: within a run
LONG_LIVED_S = 365 * 86400.0  # the seed's and the stageless members': signed offline
GIB = 1 << 30
# What every node reports: the same on every machine, so a scenario replays anywhere.
SIM_HARDWARE = HardwareReport(
    device="cpu",
    device_name="simulated",
    device_memory_bytes=32 * GIB,
    host_memory_bytes=128 * GIB,
    cpu_count=8,
)


def authorized_run(run: RunConfig, key: NodeKey) -> RunConfig:
    """``run`` with its admission authorized by ``key``, floors off, credentials short."""
    admission = dataclasses.replace(
        run.admission,
        mode="authorized",
        authorizer_public_key=key.public_key.hex(),
        credential_lifetime_s=SIM_CREDENTIAL_S,
        min_device_memory_gb=0.0,
        min_host_memory_gb=0.0,
        min_bandwidth_mbps=0.0,
        max_latency_ms=0.0,
        bandwidth_probe_bytes=1 << 20,
        max_nodes_per_account=1_000_000,
        admissions_per_minute=120.0,
        admission_burst=16,
    )
    return dataclasses.replace(run, admission=admission)


class SwarmAuthority:
    """The authorizer of one simulated swarm, and how its nodes are built to be admitted (the
    methods of ``swarm_nodes.OpenNodes``)."""

    own_members = 1  # the authorizer

    def __init__(self, swarm: _Swarm):
        self.swarm = swarm
        self.key = swarm.sim.key()
        swarm.run = self.run = authorized_run(swarm.run, self.key)
        self.store = Store.open(str(swarm.folder / "authorizer.db"))
        self.token = world.token_hex(16)
        self.store.add_account(ACCOUNT, self.token, now=world.wall())
        self.authorizer: Authorizer | None = None
        self.seed_key: NodeKey | None = None

    def seed(self, key: NodeKey) -> tuple[RunNode, DhtNode]:
        """(what to start, its DHT node) of the run's first member."""
        self.seed_key = key
        node = self._credentialed(key, bootstrap=())
        return node, node.dht

    def after_seed(self) -> None:
        """The authorizer, a member too, before any node asks it to join."""
        host = self.swarm.host("authorizer")
        with host.active():
            self.authorizer = Authorizer(
                run=self.run, key=self.key, store=self.store, bootstrap=self.bootstrap()
            )
        self.swarm.sim.run(self.swarm._start(self.authorizer, host))

    def member(self, key: NodeKey) -> tuple[RunNode, DhtNode]:
        node = self._credentialed(key, bootstrap=self.bootstrap())
        return node, node.dht

    def _credentialed(self, key: NodeKey, *, bootstrap: list[str] | tuple) -> RunNode:
        """A DHT member's node holding its operator-signed credential."""
        credential = issue_operator_credential(
            self.store,
            run=self.run,
            authorizer=self.key,
            node=key,
            role="dht",
            stage=None,
            lifetime_s=LONG_LIVED_S,
        )
        return RunNode(
            run=self.run,
            key=key,
            metrics=NodeMetrics(role="dht", instance=key.node_id[:12]),
            bootstrap=bootstrap,
            credential=credential,
        )

    def bootstrap(self) -> list[str]:
        """The seed as an authorized run names it: its key, then its address."""
        assert self.seed_key is not None
        return [f"{self.seed_key.public_key.hex()}@{self.swarm.seed.address}"]

    def _admitted(self, key: NodeKey, role: str, *, stage: int | None = None) -> RoleNode:
        """The member a worker or trainer of ``role`` runs on, with the admission that serves
        the dial-back on its port."""
        assert self.authorizer is not None and self.authorizer.address is not None
        member = RoleNode.build(
            role, self.run, key, stage=stage, bootstrap=self.bootstrap(), authorizer=self.authorizer.address
        )
        joining = NodeSettings(authorizer=self.authorizer.address, account=ACCOUNT, account_token=self.token)
        member.ask_authorizer(joining, SIM_HARDWARE, matmul=device_matmul(torch.device("cpu")))
        return member

    def worker(self, stage: int, key: NodeKey, settings: WorkerSettings) -> Worker:
        """A worker for ``stage``, pinned there; :meth:`start_worker` admits and starts it."""
        self.store.pin(key.node_id, stage, now=world.wall())
        member = self._admitted(key, "worker", stage=stage)
        return Worker(run=self.run, stage=stage, key=key, settings=settings, member=member)

    def start(self, node):
        """``node``'s start: a worker or trainer is admitted first."""
        if isinstance(node, Worker):
            return self._start_worker(node)
        if isinstance(node, Trainer):
            return self._start_trainer(node)
        return node.start()

    @staticmethod
    async def _start_worker(worker: Worker) -> str:
        """Submit, learn the stage while queued (downloading meanwhile), then serve."""
        await worker.admission.submit()
        stage = await worker.admission.placed()
        if stage != worker.stage:
            raise AssertionError(f"the authorizer placed a worker pinned to stage {worker.stage} on {stage}")
        return await worker.start()

    def trainer(self, key: NodeKey, shards, settings: TrainerSettings) -> Trainer:
        member = self._admitted(key, "trainer")
        return Trainer(run=self.run, shards_dir=shards, key=key, settings=settings, member=member)

    @staticmethod
    async def _start_trainer(trainer: Trainer) -> None:
        await trainer.admission.submit()
        await trainer.start()  # routes once admitted

    def summary(self, nodes: list) -> dict:
        """Admission figures: nodes holding a valid credential now, refreshes, losses."""
        keepers = _keepers(nodes)
        return {
            "credentialed": sum(1 for n in nodes if n.admission.valid),
            "credential_refreshes": sum(k.refreshes for k in keepers),
            "credentials_lost": sum(1 for n in nodes if n.admission.lost is not None),
        }

    @staticmethod
    def credentials_settled(nodes: list) -> bool:
        """Whether no node's credential is in its refresh window still unrenewed: each one
        refreshed since (its next window is ahead), or was lost (its node exits, as it
        should). A fault that covered a refresh window shows only later: the refresh that
        follows may still fail, and the credential run out, after the network healed."""
        now = world.wall()
        return all(k.lost is not None or now < k.current.credential.refresh_at for k in _keepers(nodes))


def _keepers(nodes: list) -> list:
    """The credential keepers of ``nodes`` that were admitted (a queued node has none yet)."""
    return [n.admission.keeper for n in nodes if n.admission.keeper is not None]
