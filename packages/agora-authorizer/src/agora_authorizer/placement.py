"""Stage placement: each admitted worker goes to the stage with the least capacity for its demand.

The pipeline runs at the pace of its least-provisioned stage, so the authorizer, not the
contributor, picks the stage. A stage's capacity is what its workers announce in the DHT
(their measured samples per second) plus the workers already promised to it (admitted but not
announced yet, or queued and placed), each counted at the stage's mean per-worker rate. Until
every stage has a measured rate, capacity is a worker count, and demand is the stage's layer
count (a stage of two layers needs twice the workers of a stage of one). Ties go to the
lower stage. An operator's pin (``agora-authorizer pin``) overrides all of it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agora_authorizer.store import Store
from agora_core import world
from agora_core.config import RunConfig
from agora_core.dht import DhtNode
from agora_core.errors import AgoraError
from agora_core.schema import WorkerAnnouncement, parse_entries, stage_workers_key


@dataclass
class StageLoad:
    stage: int
    layers: int  # its demand, until rates are measured
    announced: dict[str, float] = field(default_factory=dict)  # node id -> samples/s
    promised: set[str] = field(default_factory=set)  # admitted or queued for it, not announced

    @property
    def workers(self) -> int:
        return len(self.announced) + len(self.promised - set(self.announced))

    @property
    def mean_rate(self) -> float:
        rates = [r for r in self.announced.values() if r > 0]
        return sum(rates) / len(rates) if rates else 0.0


def choose_stage(loads: list[StageLoad]) -> int:
    if not loads:
        raise ValueError("a run has at least one stage")
    measured = all(load.mean_rate > 0 for load in loads)

    def score(load: StageLoad) -> tuple[float, int]:
        if measured:
            return (load.workers * load.mean_rate, load.stage)
        return (load.workers / max(1, load.layers), load.stage)

    return min(loads, key=score).stage


async def read_loads(dht: DhtNode, run_name: str, stage_layers: list[int]) -> list[StageLoad]:
    """Every stage's announced workers, from the DHT (a failed read counts as none)."""
    loads = []
    for stage, layers in enumerate(stage_layers):
        load = StageLoad(stage=stage, layers=layers)
        try:
            values = await dht.get(stage_workers_key(run_name, stage))
        except AgoraError:  # the DHT is one signal; placement still works on promises alone
            values = {}
        for announcement in parse_entries(values, WorkerAnnouncement.from_value):
            if announcement.stage == stage:
                load.announced[announcement.node_id] = announcement.throughput
        loads.append(load)
    return loads


class Placer:
    """Stage loads for placement: the DHT's announcements, cached for ``cache_s``, plus the
    workers promised to each stage (queued, or admitted within ``promise_s`` and not yet
    announced). The caller serializes placements, so each sees the ones before it."""

    def __init__(
        self,
        *,
        run: RunConfig,
        dht: DhtNode,
        store: Store,
        db: Callable[..., Awaitable[Any]],
        cache_s: float = 1.0,
        promise_s: float = 120.0,
    ):
        self.run = run
        self.dht = dht
        self.store = store
        self.db = db
        self.cache_s = cache_s
        self.promise_s = promise_s
        self._loads: tuple[float, list[StageLoad]] | None = None

    async def loads(self) -> list[StageLoad]:
        now = world.monotonic()
        if self._loads is not None and now - self._loads[0] < self.cache_s:
            return self._loads[1]
        loads = await read_loads(self.dht, self.run.name, list(self.run.model.stage_layers))
        wall = world.wall()
        for credential in await self.db(self.store.live_credentials, now=wall):
            if credential.stage is not None and credential.issued > wall - self.promise_s:
                loads[credential.stage].promised.add(credential.node_id)
        for queued in await self.db(self.store.queued):
            if queued.stage is not None:
                loads[queued.stage].promised.add(queued.node_id)
        self._loads = (now, loads)
        return loads

    async def least_provisioned(self) -> int:
        return choose_stage(await self.loads())

    def promise(self, stage: int, node_id: str) -> None:
        """A worker was just placed on ``stage``: count it until the next DHT read does."""
        if self._loads is not None:
            self._loads[1][stage].promised.add(node_id)
