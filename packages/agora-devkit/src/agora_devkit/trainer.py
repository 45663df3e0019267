"""Stand-ins for a two-stage swarm, for tests of the trainer on real sockets and a real DHT.

Each stage is a plain RPC server on 127.0.0.1 that answers like a head or a tail (shapes
right, values constant) and refuses a non-finite gradient as a worker's input check does, so
a test of routing, injection or shard rotation imports no torch and spends no compute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from agora_core.config import RunConfig
from agora_core.config.run import DhtConfig, ModelConfig
from agora_core.contract import Method, Phase
from agora_core.dht import DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.errors import BadRequest
from agora_core.identity import NodeKey
from agora_core.rpc import Payload, RpcServer
from agora_core.schema import WorkerAnnouncement, stage_workers_key
from agora_trainer.settings import TrainerSettings
from agora_trainer.trainer import Trainer


def stand_in_run(name: str, k: int, **fields) -> RunConfig:
    """The run config a :class:`StandInSwarm` serves: two surrogate stages of boundary width
    ``k``, byte tokens, samples of 8, a DHT that detects a departure within seconds;
    ``fields``: other RunConfig fields (an ``operator``, say)."""
    model = ModelConfig(
        kind="surrogate",
        d_model=32,
        n_heads=2,
        subspace_rank=k,
        vocab_size=256,
        seq_len=8,
        stage_layers=(1, 1),
    )
    dht = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
    return RunConfig(name=name, model=model, dht=dht, **fields)


class StandInStage:
    """A head (stage 0) or a tail (stage 1) of boundary width ``k``; records the gradients it
    got. A head's output is ``boundary(tokens)`` (B, T) -> (B, T, k) (zeros unless given)."""

    def __init__(self, stage: int, k: int, boundary: Callable[[np.ndarray], np.ndarray] | None = None):
        self.stage, self.k, self.grads = stage, k, []
        self.boundary = boundary or (lambda tokens: np.zeros((*tokens.shape, k), np.float32))
        self.key = NodeKey.generate()  # its node id, as announced
        self.server = RpcServer(listen="127.0.0.1:0")
        if stage == 0:
            self.server.register(Method.FORWARD, self.forward)
            self.server.register(Method.BACKWARD, self.backward)
        else:
            self.server.register(Method.FORWARD_BACKWARD, self.forward_backward)

    def forward(self, request) -> Payload:
        return Payload(tensors={"boundary": self.boundary(request.tensors["tokens"])})

    def backward(self, request) -> Payload:
        grad = request.tensors["grad"]
        self.grads.append(grad)
        if not np.isfinite(grad).all():  # a worker's input check (agora_worker.serving.tensors)
            raise BadRequest("'grad' holds NaN or infinite values")
        return Payload()

    def forward_backward(self, request) -> Payload:
        tokens = request.tensors["tokens"]
        return Payload(
            tensors={"loss": np.ones(1, np.float32), "grad": np.ones((*tokens.shape, self.k), np.float32)}
        )

    async def announce(self, dht: DhtNode, run_name: str, key: NodeKey | None = None) -> None:
        """Announce this stage as a serving worker of ``run_name`` (for a minute)."""
        key = key or self.key
        announcement = WorkerAnnouncement(
            node_id=key.node_id,
            address=self.server.address,
            stage=self.stage,
            phase=Phase.SERVING,
            throughput=100.0,
            load=0,
            max_batch=8,
            version="test",
        )
        await OwnedEntry(dht, key, stage_workers_key(run_name, self.stage)).publish(
            announcement.to_value(), 60
        )


class StandInSwarm:
    """A seed DHT node and a stand-in head and tail announced in it, for ``async with``; the
    trainers made by :meth:`trainer` bootstrap from the seed and are closed with the swarm."""

    def __init__(self, run: RunConfig, k: int, heads: Sequence[StandInStage] = ()):
        """``heads``: the head replicas (default: one of zeros)."""
        self.run, self.k = run, k
        self.seed = DhtNode(key=NodeKey.generate(), config=run.dht)
        self.stages = [*(heads or [StandInStage(0, k)]), StandInStage(1, k)]
        self.trainers: list[Trainer] = []

    async def __aenter__(self) -> StandInSwarm:
        await self.seed.start()
        try:
            for stage in self.stages:
                await stage.server.start()
                await stage.announce(self.seed, self.run.name)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    def trainer(self, shards_dir: Path, **settings) -> Trainer:
        """A trainer of this swarm (not started); ``settings`` are TrainerSettings fields."""
        settings = {"lanes": 2, "refresh_interval_s": 0.5, "progress_interval_s": 0.2, **settings}
        trainer = Trainer(
            run=self.run,
            shards_dir=shards_dir,
            key=NodeKey.generate(),
            bootstrap=[self.seed.address],
            settings=TrainerSettings(**settings),
        )
        self.trainers.append(trainer)
        return trainer

    async def __aexit__(self, *exc) -> None:
        for trainer in self.trainers:
            await trainer.close()
        for stage in self.stages:
            await stage.server.stop()
        await self.seed.stop()
