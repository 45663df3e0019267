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

from dataclasses import dataclass, field

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
