"""How a simulated swarm's nodes are built and started: an open run's, as the packages' own
constructors build them.

An authorized run's builder (``swarm_auth.SwarmAuthority``) has the same methods, so
``swarm`` builds and starts every node one way, whichever kind of run it simulates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_trainer.trainer import Trainer, TrainerSettings
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

if TYPE_CHECKING:
    from agora_sim.swarm import _Swarm


class OpenNodes:
    """An open run's nodes: nothing to admit, the seed's address is all a joiner needs."""

    own_members = 0  # DHT members the builder runs itself

    def __init__(self, swarm: _Swarm):
        self.swarm = swarm

    def seed(self, key: NodeKey) -> tuple[DhtNode, DhtNode]:
        """(what to start, its DHT node) of the run's first member."""
        node = DhtNode(key=key, config=self.swarm.run.dht)
        return node, node

    def after_seed(self) -> None:
        """Nothing else runs before the members join."""

    def bootstrap(self) -> list[str]:
        return [self.swarm.seed.address]

    def member(self, key: NodeKey) -> tuple[DhtNode, DhtNode]:
        node = DhtNode(key=key, config=self.swarm.run.dht, bootstrap=self.bootstrap())
        return node, node

    def worker(self, stage: int, key: NodeKey, settings: WorkerSettings) -> Worker:
        return Worker(run=self.swarm.run, stage=stage, key=key, bootstrap=self.bootstrap(), settings=settings)

    def trainer(self, key: NodeKey, shards, settings: TrainerSettings) -> Trainer:
        return Trainer(
            run=self.swarm.run, shards_dir=shards, key=key, bootstrap=self.bootstrap(), settings=settings
        )

    @staticmethod
    def start(node):
        return node.start()

    def summary(self, nodes: list) -> dict:
        """Nothing about admission to report."""
        return {}

    @staticmethod
    def credentials_settled(nodes: list) -> bool:
        """No credentials in an open run: nothing to wait for."""
        return True
