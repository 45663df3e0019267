"""A whole swarm in the simulator: real workers and trainers on simulated hosts, in virtual time.

The scenario's ``[swarm]`` table (next to ``[run]`` and ``[links]`` of a DHT scenario):

    [swarm]
    stages = 4
    workers_per_stage = 2
    trainers = 1
    lanes = 4                 # microbatches each trainer keeps in flight
    forward_ms = 5.0          # per sample, on a worker of speed 1 (surrogate stages)
    backward_ms = 10.0
    speed = [0.5, 1.5]        # each worker's compute speed, drawn uniformly: heterogeneous GPUs
    stage_cost = []           # each stage's compute per sample, x forward_ms/backward_ms (1 each)
    target_batch_size = 64    # samples per optimizer step of a stage
    averaging = true
    averaging_every_steps = 20  # a round per this many optimizer steps (the report's 20)
    matchmaking_s = 40.0      # the matchmaking window (the report's 40 s)
    averaged_parameters = 0   # untrained parameters per stage that averaging moves too (payload)
    worker_departures_per_min = 0.0  # workers whose process dies (each stage keeps one)
    worker_joins_per_min = 0.0       # new workers, each downloading its stage's state
    trainer_crashes_per_min = 0.0    # trainers whose process dies (swarm_trainers) ...
    trainer_restart_s = 10.0         # ... and restarts this long after on its own state file
    dht_members = 0           # DHT members that host no stage (the run's other nodes: monitors...)
    start_batch = 1           # workers (members, trainers) started together; 1: one after another
    settle_gossip_s = 0.0     # up to this long after start-up for the joins' news to stop
                              # circulating before the measured stretch (training goes on)
    authorized = false        # the run's authorizer admits every node (swarm_auth)

and ``[faults]`` (partitions, silent hosts, clock skew, slowed workers: ``swarm_faults``).

Every node is the packages' own: ``agora_worker.Worker`` (queues, coalescing, optimizer,
averaging, progress, announcements) on a surrogate stage whose compute time is waited out in
virtual time, ``agora_trainer.Trainer`` (shards, balancer, routing) on byte shards, a DHT
seed. The report: samples and tokens per virtual second, each stage's utilization (compute
time / virtual time, its replicas' mean) and the bottleneck, optimizer steps, averaging rounds
and their success, samples completed, retried and lost, and the trace digest.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_sim import Simulation
from agora_sim.dht_swarm import LinkRange
from agora_sim.scenario import ScenarioError
from agora_sim.swarm_auth import SwarmAuthority
from agora_sim.swarm_faults import Disturbances, SwarmFaults, check_settled, completed_twice
from agora_sim.swarm_nodes import OpenNodes
from agora_sim.swarm_summary import swarm_summary
from agora_sim.swarm_trainers import SwarmTrainers
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

SEQ_LEN = 128


@dataclass(kw_only=True, frozen=True)
class SwarmScenario:
    seed: int = 1
    duration_s: float = 60.0
    stages: int = 4
    workers_per_stage: int = 2
    trainers: int = 1
    lanes: int = 4
    forward_ms: float = 5.0
    backward_ms: float = 10.0
    speed: tuple[float, float] = (1.0, 1.0)
    stage_cost: tuple[float, ...] = ()
    target_batch_size: int = 64
    averaging: bool = True
    averaging_every_steps: int = 20
    matchmaking_s: float = 40.0
    averaged_parameters: int = 0
    worker_departures_per_min: float = 0.0
    worker_joins_per_min: float = 0.0
    trainer_crashes_per_min: float = 0.0
    trainer_restart_s: float = 10.0
    dht_members: int = 0
    start_batch: int = 1
    settle_gossip_s: float = 0.0
    authorized: bool = False
    links: LinkRange = field(default_factory=LinkRange)
    faults: SwarmFaults = field(default_factory=SwarmFaults)

    def __post_init__(self) -> None:
        if self.stages < 2 or self.workers_per_stage < 1 or self.trainers < 1 or self.lanes < 1:
            raise ScenarioError("swarm: stages >= 2, workers_per_stage, trainers and lanes >= 1")
        if not 0 < self.speed[0] <= self.speed[1]:
            raise ScenarioError("swarm.speed must be [low, high] with 0 < low <= high")
        if self.stage_cost and (len(self.stage_cost) != self.stages or min(self.stage_cost) <= 0):
            raise ScenarioError("swarm.stage_cost needs one positive factor per stage")
        if self.dht_members < 0 or self.start_batch < 1 or self.settle_gossip_s < 0:
            raise ScenarioError("swarm: dht_members >= 0, start_batch >= 1 and settle_gossip_s >= 0")
        if self.duration_s <= 0 or self.forward_ms < 0 or self.backward_ms < 0:
            raise ScenarioError("run.duration_s must be positive, swarm.*_ms >= 0")
        if self.trainer_crashes_per_min < 0 or self.trainer_restart_s <= 0:
            raise ScenarioError("swarm: trainer_crashes_per_min >= 0 and trainer_restart_s > 0")


SWARM_KEYS = {f for f in SwarmScenario.__dataclass_fields__} - {"seed", "duration_s", "links", "faults"}


def parse_swarm(data: dict) -> SwarmScenario:
    unknown = set(data) - {"run", "swarm", "links", "faults"}
    if unknown:
        raise ScenarioError(
            f"a swarm scenario has [run], [swarm], [links] and [faults]; unknown: {', '.join(sorted(unknown))}"
        )
    faults = data.get("faults", {})
    bad = set(faults) - set(SwarmFaults.__dataclass_fields__)
    if bad:
        raise ScenarioError(f"[faults] has unknown keys: {', '.join(sorted(bad))}")
    swarm = dict(data.get("swarm", {}))
    bad = set(swarm) - SWARM_KEYS
    if bad:
        raise ScenarioError(f"[swarm] has unknown keys: {', '.join(sorted(bad))}")
    run = data.get("run", {})
    for name in ("speed", "stage_cost"):
        if name in swarm:
            swarm[name] = tuple(float(v) for v in swarm[name])
    links = {k: tuple(v) if isinstance(v, list) else v for k, v in data.get("links", {}).items()}
    try:
        return SwarmScenario(
            seed=int(run.get("seed", 1)),
            duration_s=float(run.get("duration_s", 60.0)),
            links=LinkRange(**links),
            faults=SwarmFaults(**{k: float(v) for k, v in faults.items()}),
            **swarm,
        )
    except TypeError as exc:
        raise ScenarioError(str(exc)) from None


def _run_config(scenario: SwarmScenario, folder: Path):
    layers = ", ".join(["1"] * scenario.stages)
    path = folder / "run.toml"
    path.write_text(
        f'name = "sim"\nseed = {scenario.seed}\n[model]\nkind = "surrogate"\nd_model = 64\nn_heads = 2\n'
        f"subspace_rank = 16\nseq_len = {SEQ_LEN}\nvocab_size = 256\nstage_layers = [{layers}]\n"
        f"[model.surrogate]\nforward_delay_s = {scenario.forward_ms / 1000}\nbackward_delay_s = {scenario.backward_ms / 1000}\n"
        f"dummy_parameters = {scenario.averaged_parameters}\n"
        f"[optimizer]\ntarget_batch_size = {scenario.target_batch_size}\n"
        f"[averaging]\nenabled = {'true' if scenario.averaging else 'false'}\n"
        f"cadence_steps = {scenario.averaging_every_steps}\nmatchmaking_window_s = {scenario.matchmaking_s}\n"
        f"round_timeout_s = {scenario.matchmaking_s + 110.0}\n"
        # the simulator injects its own faults: no node reads the operator's injection records
        "[operator]\ninjection_watch_s = 0\n"
    )
    return load_run_config(path)


@dataclass
class SwarmResult:
    scenario: SwarmScenario
    summary: dict = field(default_factory=dict)


class _Swarm:
    """The nodes of one simulated swarm, and the churn that comes and goes among its workers."""

    def __init__(self, sim: Simulation, scenario: SwarmScenario, run, folder: Path):
        self.sim, self.scenario, self.run, self.folder = sim, scenario, run, folder
        self.rng = sim.rng()
        self.workers: list[Worker] = []
        self.hosts: list = []  # each worker's host
        self.dead: set[int] = set()  # indexes into workers
        self.members: list[DhtNode] = []  # the DHT members that host no stage
        self.trainer_set = SwarmTrainers(self)
        self.disturbances = Disturbances(self)
        # how nodes are built and started: an authorized run's are admitted by its authorizer
        self.nodes = SwarmAuthority(self) if scenario.authorized else OpenNodes(self)
        with self.host("seed").active():
            seed, self.seed = self.nodes.seed(sim.key())
            sim.run(seed.start())
        self.nodes.after_seed()

    def host(self, name: str):
        host = self.sim.network.add_host(name, self.scenario.links.draw(self.rng))
        skew = self.scenario.faults.max_clock_skew_s
        if skew:
            host.skew_s = self.rng.uniform(-skew, skew)
        return host

    def new_worker(self, stage: int) -> tuple[Worker, object]:
        speed = self.rng.uniform(*self.scenario.speed)
        host = self.host(f"worker-{stage}.{len(self.workers)}")
        settings = WorkerSettings(surrogate_delay_scale=self.stage_cost(stage) / speed)
        with host.active():
            worker = self.nodes.worker(stage, self.sim.key(), settings)
        self.workers.append(worker)
        self.hosts.append(host)
        return worker, host

    def stage_cost(self, stage: int) -> float:
        return self.scenario.stage_cost[stage] if self.scenario.stage_cost else 1.0

    def start_workers(self) -> None:
        """Every stage's workers, ``start_batch`` at a time (stage by stage, round-robin), so a
        thousand workers come up in the virtual time of a few joins, not a thousand."""
        order = [
            stage for _ in range(self.scenario.workers_per_stage) for stage in range(self.scenario.stages)
        ]
        if self.scenario.start_batch == 1:  # the order the published figures were measured in
            order.sort()
        for first in range(0, len(order), self.scenario.start_batch):
            group = [
                self._start(*self.new_worker(stage))
                for stage in order[first : first + self.scenario.start_batch]
            ]
            self.sim.run(group[0] if len(group) == 1 else asyncio.gather(*group))
            self.sim.freeze_heap()  # the workers stay: later collections need not walk them

    async def _start(self, node, host) -> None:
        with host.active():
            await self.nodes.start(node)

    def start_members(self) -> None:
        for first in range(0, self.scenario.dht_members, self.scenario.start_batch):
            group = []
            for index in range(first, min(first + self.scenario.start_batch, self.scenario.dht_members)):
                host = self.host(f"member-{index}")
                with host.active():
                    node, dht = self.nodes.member(self.sim.key())
                group.append((node, host))
                self.members.append(dht)
            self.sim.run(asyncio.gather(*(self._start(node, host) for node, host in group)))
            self.sim.freeze_heap()

    @property
    def trainers(self) -> list[Trainer]:
        return self.trainer_set.nodes

    @property
    def train_tasks(self) -> list[asyncio.Task]:
        return self.trainer_set.tasks

    def dht_nodes(self) -> list[DhtNode]:
        workers = [self.workers[i].dht for i in self.live()]
        return [self.seed, *workers, *self.members, *(t.dht for t in self.trainers)]

    def settle(self, limit_s: float) -> float | None:
        """Virtual seconds until no node has a membership update left to gossip (None when
        ``limit_s`` passes first; 0 without a limit). A swarm that all joins within seconds
        repeats each join about 4 log2(N) times to everyone, a burst no real run sees."""
        if limit_s <= 0:
            return 0.0
        started = self.sim.elapsed_s
        while any(node.table.pending_gossip for node in self.dht_nodes()):
            if self.sim.elapsed_s - started >= limit_s:
                return None
            self.sim.run_for(1.0)
        return self.sim.elapsed_s - started

    def live(self, stage: int | None = None) -> list[int]:
        return [i for i, w in enumerate(self.workers) if i not in self.dead and stage in (None, w.stage)]


def run_swarm_scenario(
    scenario: SwarmScenario,
    *,
    shards: Path | None = None,
    check: bool = False,
    progress: Callable[[str], None] | None = None,
) -> SwarmResult:
    """Run ``scenario``; with ``check``, settle it afterwards and check what must hold
    (``swarm_faults.check_settled``): the violations are in the summary. ``progress``
    hears each start-up phase as it ends (a thousand workers take minutes to come up)."""
    torch.manual_seed(scenario.seed)  # the surrogates' untrained parameters: part of the replay
    real_started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agora-sim-") as scratch:
        folder = Path(scratch)
        run = _run_config(scenario, folder)
        if shards is None:
            shards = folder / "shards"
            make_shards(
                shards, shards=max(2, scenario.trainers), tokenizer=ByteTokenizer(), max_bytes=2_000_000
            )
        with Simulation(seed=scenario.seed) as sim:
            swarm = _Swarm(sim, scenario, run, folder)

            def phase(what: str) -> None:
                if progress is not None:
                    real_s = time.perf_counter() - real_started
                    progress(f"{what} ({sim.elapsed_s:.1f} virtual s, {real_s:.1f} real s)")

            swarm.start_workers()
            phase(f"{len(swarm.workers)} workers up")
            swarm.start_members()
            phase(f"{len(swarm.members)} stageless DHT members up")
            swarm.trainer_set.start(shards)
            phase(f"{len(swarm.trainers)} trainers up")
            settled_s = swarm.settle(scenario.settle_gossip_s)
            sim.freeze_heap()
            if scenario.settle_gossip_s:
                phase("the joins' gossip " + ("settled" if settled_s is not None else "still circulating"))
            startup_real_s = time.perf_counter() - real_started
            started_s = sim.elapsed_s
            busy_before = [w.runtime.compute_seconds for w in swarm.workers]
            steady_started = time.perf_counter()
            disturbing = sim.loop.create_task(swarm.disturbances.run(scenario.duration_s))
            sim.run_for(scenario.duration_s)
            disturbing.cancel()
            steady_real_s = time.perf_counter() - steady_started
            elapsed_s = sim.elapsed_s - started_s
            summary = swarm_summary(scenario, swarm, busy_before, elapsed_s, seq_len=SEQ_LEN)
            summary["steady_virtual_s_per_real_s"] = elapsed_s / steady_real_s  # start-up left out
            summary["startup_virtual_s"], summary["startup_real_s"] = started_s, startup_real_s
            summary["gossip_settled_s"] = settled_s
            summary["digest"] = sim.digest()
            summary["messages"] = sim.trace.messages
            summary["virtual_s"] = sim.elapsed_s
            summary["completed_twice"] = sum(
                completed_twice(folder / f"losses-{i}.jsonl") for i in range(len(swarm.trainers))
            )
            if check:
                summary["violations"], seen = check_settled(swarm)
                summary.update(seen)
                summary["digest_settled"] = sim.digest()
            else:
                for trainer in swarm.trainers:
                    trainer.request_stop()
    summary["real_s"] = time.perf_counter() - real_started
    summary["virtual_s_per_real_s"] = summary["virtual_s"] / summary["real_s"]
    return SwarmResult(scenario, summary)
