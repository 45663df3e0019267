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
    target_batch_size = 64    # samples per optimizer step of a stage
    averaging = true
    averaging_every_steps = 20  # a round per this many optimizer steps (the report's 20)
    matchmaking_s = 40.0      # the matchmaking window (the report's 40 s)
    averaged_parameters = 0   # untrained parameters per stage that averaging moves too (payload)

Every node is the packages' own: ``agora_worker.Worker`` (queues, coalescing, optimizer,
averaging, progress, announcements) on a surrogate stage whose compute time is waited out in
virtual time, ``agora_trainer.Trainer`` (shards, balancer, routing) on byte shards, a DHT
seed. The report: samples and tokens per virtual second, each stage's utilization (compute
time / virtual time, its replicas' mean) and the bottleneck, optimizer steps, averaging rounds
and their success, samples completed, retried and lost, and the trace digest.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_core.sim import Simulation
from agora_core.sim.dht_swarm import LinkRange
from agora_core.sim.scenario import ScenarioError
from agora_trainer.sharding import make_shards
from agora_trainer.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings
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
    target_batch_size: int = 64
    averaging: bool = True
    averaging_every_steps: int = 20
    matchmaking_s: float = 40.0
    averaged_parameters: int = 0
    links: LinkRange = field(default_factory=LinkRange)

    def __post_init__(self) -> None:
        if self.stages < 2 or self.workers_per_stage < 1 or self.trainers < 1 or self.lanes < 1:
            raise ScenarioError("swarm: stages >= 2, workers_per_stage, trainers and lanes >= 1")
        if not 0 < self.speed[0] <= self.speed[1]:
            raise ScenarioError("swarm.speed must be [low, high] with 0 < low <= high")
        if self.duration_s <= 0 or self.forward_ms < 0 or self.backward_ms < 0:
            raise ScenarioError("run.duration_s must be positive, swarm.*_ms >= 0")


SWARM_KEYS = {f for f in SwarmScenario.__dataclass_fields__} - {"seed", "duration_s", "links"}


def parse_swarm(data: dict) -> SwarmScenario:
    unknown = set(data) - {"run", "swarm", "links"}
    if unknown:
        raise ScenarioError(
            f"a swarm scenario has [run], [swarm] and [links]; unknown: {', '.join(sorted(unknown))}"
        )
    swarm = dict(data.get("swarm", {}))
    bad = set(swarm) - SWARM_KEYS
    if bad:
        raise ScenarioError(f"[swarm] has unknown keys: {', '.join(sorted(bad))}")
    run = data.get("run", {})
    if "speed" in swarm:
        swarm["speed"] = tuple(float(v) for v in swarm["speed"])
    links = {k: tuple(v) if isinstance(v, list) else v for k, v in data.get("links", {}).items()}
    try:
        return SwarmScenario(
            seed=int(run.get("seed", 1)),
            duration_s=float(run.get("duration_s", 60.0)),
            links=LinkRange(**links),
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
    )
    return load_run_config(path)


@dataclass
class SwarmResult:
    scenario: SwarmScenario
    summary: dict = field(default_factory=dict)


def run_swarm_scenario(scenario: SwarmScenario, *, shards: Path | None = None) -> SwarmResult:
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
            rng = sim.rng()

            def host(name: str):
                return sim.network.add_host(name, scenario.links.draw(rng))

            with host("seed").active():
                seed = DhtNode(key=sim.key(), config=run.dht)
                sim.run(seed.start())
            workers: list[Worker] = []
            for stage in range(scenario.stages):
                for replica in range(scenario.workers_per_stage):
                    speed = rng.uniform(*scenario.speed)
                    with host(f"worker-{stage}.{replica}").active():
                        worker = Worker(
                            run=run,
                            stage=stage,
                            key=sim.key(),
                            bootstrap=[seed.address],
                            settings=WorkerSettings(surrogate_delay_scale=1.0 / speed),
                        )
                        sim.run(worker.start())
                    workers.append(worker)
            trainers: list[Trainer] = []
            for index in range(scenario.trainers):
                with host(f"trainer-{index}").active():
                    trainer = Trainer(
                        run=run,
                        shards_dir=shards,
                        key=sim.key(),
                        bootstrap=[seed.address],
                        settings=TrainerSettings(
                            lanes=scenario.lanes, state_file=str(folder / f"trainer-{index}.json")
                        ),
                    )
                    sim.run(trainer.start())
                    sim.loop.create_task(trainer.train())
                trainers.append(trainer)
            started_s = sim.elapsed_s
            busy_before = [w.runtime.compute_seconds for w in workers]
            steady_started = time.perf_counter()
            sim.run_for(scenario.duration_s)
            steady_real_s = time.perf_counter() - steady_started
            elapsed_s = sim.elapsed_s - started_s
            summary = _summary(scenario, workers, trainers, busy_before, elapsed_s)
            summary["steady_virtual_s_per_real_s"] = elapsed_s / steady_real_s  # start-up left out
            summary["digest"] = sim.digest()
            summary["messages"] = sim.trace.messages
            for trainer in trainers:
                trainer.request_stop()
            summary["virtual_s"] = sim.elapsed_s
    summary["real_s"] = time.perf_counter() - real_started
    summary["virtual_s_per_real_s"] = summary["virtual_s"] / summary["real_s"]
    return SwarmResult(scenario, summary)


def _summary(scenario: SwarmScenario, workers, trainers, busy_before, elapsed_s: float) -> dict:
    utilization = []
    for stage in range(scenario.stages):
        replicas = [i for i, w in enumerate(workers) if w.stage == stage]
        busy = [(workers[i].runtime.compute_seconds - busy_before[i]) / elapsed_s for i in replicas]
        utilization.append(sum(busy) / len(busy))
    rounds = [r for w in workers for r in w.averager.reports]
    completed = sum(t.counters.completed for t in trainers)
    return {
        "seed": scenario.seed,
        "workers": len(workers),
        "trainers": len(trainers),
        "samples_per_s": completed / elapsed_s,
        "tokens_per_s": completed * SEQ_LEN / elapsed_s,
        "stage_utilization": utilization,
        "bottleneck_stage": max(range(scenario.stages), key=lambda s: utilization[s]),
        "optimizer_steps": [w.optimizer.step for w in workers],
        "averaging_rounds": len(rounds),
        "averaging_success": sum(r.averaging_success for r in rounds) / len(rounds) if rounds else None,
        "averaging_round_s": sum(r.seconds for r in rounds) / len(rounds) if rounds else None,
        "completed": completed,
        # every sample taken from the shards is completed, on its way, or waiting to run again
        "lost": sum(
            t.counters.dispatched - t.counters.completed - t.counters.in_flight - t.counters.requeued
            for t in trainers
        ),
        "retries": sum(t.counters.retries for t in trainers),
        "in_flight_at_end": sum(t.counters.in_flight for t in trainers),
        "requeued": sum(t.counters.requeued for t in trainers),
    }
