"""What disturbs a simulated swarm, and what must still hold once it settles.

A swarm scenario's ``[faults]`` (next to ``[swarm]``'s worker churn), each a Poisson process
per minute of virtual time that heals by itself:

    [faults]
    partitions_per_min = 0.0  # the live hosts (workers, trainers, the seed) cut in two groups
    partition_s = 10.0
    silences_per_min = 0.0    # one host's link cut, nobody told
    silence_s = 10.0
    max_clock_skew_s = 0.0    # each host's wall clock off by up to this (the run allows 30 s)
    slowdowns_per_min = 0.0   # one worker's compute slowed (a throttled or shared GPU)
    slowdown_factor = 4.0
    slowdown_s = 20.0

Worker departures kill a process at whatever point it is at: mid forward, mid send of an
averaging chunk, mid download of a joiner's state. After the run (``check_settled``) the
network heals, the trainers stop (their lanes finish what they hold), and then:

* no sample is lost (every sample a trainer took is completed or waiting to run again) and
  none completed twice by a trainer; a crashed trainer's restart skips none of the samples it
  held (``swarm_trainers``);
* the live replicas of each stage, idle now, run one more averaging round; it is clean (no
  fault is left), and after it they hold the same values in the segment it averaged;
* nothing grows without bound: no worker has work queued or a reduction open, no DHT member
  knows more members than ever existed.
"""

from __future__ import annotations

import asyncio
import collections
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agora_sim.scenario import Faults, ScenarioError

if TYPE_CHECKING:
    from agora_sim.swarm import _Swarm

DRAIN_LIMIT_S = 600.0  # virtual seconds the trainers get to finish the samples they hold
ROUND_LIMIT_S = 600.0  # and the replicas to finish the last averaging round
FINAL_ROUND = 1_000_000  # the checking rounds' first index: past any the run reached
FINAL_ATTEMPTS = 3  # rounds tried until one has no optimizer step during it
RESTART_TRIES = 5  # restart periods waited for the crashed trainers to be back
CREDENTIAL_WAIT_S, CREDENTIAL_TRIES = 5.0, 12  # for the credentials to be refreshed or lost
AGREE_TOLERANCE = 1e-5  # theta + (mean - theta) in float32: equal to rounding, scaled by |theta|


@dataclass(kw_only=True, frozen=True)
class SwarmFaults(Faults):
    slowdowns_per_min: float = 0.0
    slowdown_factor: float = 4.0
    slowdown_s: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.slowdown_factor < 1.0:
            raise ScenarioError("faults.slowdown_factor must be >= 1 (a slower device)")


class Disturbances:
    """Worker churn and the faults of a swarm scenario, played out over ``duration_s``."""

    def __init__(self, swarm: _Swarm):
        self.swarm = swarm
        self.rng = swarm.rng
        self.counts = collections.Counter()

    def _events(self, duration_s: float) -> list[tuple[float, str]]:
        scenario = self.swarm.scenario
        faults = scenario.faults
        rates = {
            "depart": scenario.worker_departures_per_min / 60,
            "join": scenario.worker_joins_per_min / 60,
            "partition": faults.partitions_per_min / 60,
            "silence": faults.silences_per_min / 60,
            "slowdown": faults.slowdowns_per_min / 60,
            "trainer_crash": scenario.trainer_crashes_per_min / 60,
        }
        events = []
        for kind, rate in rates.items():
            at = 0.0
            while rate > 0 and (at := at + self.rng.expovariate(rate)) < duration_s:
                events.append((at, kind))
        return sorted(events)

    async def run(self, duration_s: float) -> None:
        now = 0.0
        for at, kind in self._events(duration_s):
            await asyncio.sleep(at - now)
            now = at
            getattr(self, f"_{kind}")()

    def _live_hosts(self) -> list:
        return [h for h in self.swarm.sim.network.hosts if h.alive and h.name != "default"]

    def _depart(self) -> None:
        """A worker's process dies (no goodbye): a serving one or a joiner mid download; every
        stage keeps one serving worker (else the stage's state is gone, as in a real run)."""
        swarm = self.swarm
        live = swarm.live(self.rng.randrange(swarm.scenario.stages))
        index = self.rng.choice(live)
        serving = [i for i in live if swarm.workers[i].ready]
        if swarm.workers[index].ready and len(serving) < 2:
            return
        swarm.dead.add(index)
        self.counts["departures"] += 1
        swarm.sim.network.kill(swarm.hosts[index])

    def _join(self) -> None:
        """A new worker joins, downloading its stage's state from the replicas there."""
        swarm = self.swarm
        worker, host = swarm.new_worker(self.rng.randrange(swarm.scenario.stages))
        index = len(swarm.workers) - 1
        self.counts["joins"] += 1
        with host.active():
            task = swarm.sim.loop.create_task(swarm.nodes.start(worker))
        task.add_done_callback(lambda t: self._joined(t, index))

    def _joined(self, task, index: int) -> None:
        """A join that failed (an authorized run's authorizer refused it: it could not dial the
        joiner back through a fault) ends the process, as ``agora-worker run`` exits."""
        if task.cancelled() or task.exception() is None or index in self.swarm.dead:
            return
        self.counts["joins_failed"] += 1
        self.swarm.dead.add(index)
        self.swarm.sim.network.kill(self.swarm.hosts[index])

    def _trainer_crash(self) -> None:
        """A trainer's process dies; it restarts on its state file (``swarm_trainers``)."""
        trainers = self.swarm.trainer_set
        up = [i for i in range(len(trainers.nodes)) if i not in trainers.down]
        if up:
            trainers.crash(self.rng.choice(up))

    def _partition(self) -> None:
        network = self.swarm.sim.network
        hosts = self._live_hosts()
        if len(hosts) < 2 or any(h.group is not None for h in hosts):
            return  # one partition at a time
        self.rng.shuffle(hosts)
        cut = self.rng.randint(1, len(hosts) - 1)
        network.partition([hosts[:cut], hosts[cut:]])
        self.counts["partitions"] += 1
        self.swarm.sim.loop.call_later(self.swarm.scenario.faults.partition_s, network.heal)

    def _silence(self) -> None:
        hosts = self._live_hosts()
        if hosts:
            self.swarm.sim.network.silence(self.rng.choice(hosts), self.swarm.scenario.faults.silence_s)
            self.counts["silences"] += 1

    def _slowdown(self) -> None:
        live = self.swarm.live()
        if live:
            faults = self.swarm.scenario.faults
            worker = self.swarm.workers[self.rng.choice(live)]
            worker.runtime.slowdown.set(faults.slowdown_factor, faults.slowdown_s)
            self.counts["slowdowns"] += 1


# --- after the run -----------------------------------------------------------------------------


def check_settled(swarm: _Swarm) -> tuple[list[str], dict]:
    """Heal, drain, average once more, and check; returns the violations and what was seen."""
    sim, scenario = swarm.sim, swarm.scenario
    sim.network.heal()
    quiet_s = max(scenario.faults.silence_s, scenario.faults.slowdown_s)
    sim.run_for(quiet_s)  # the last silence and slowdown over
    for _ in range(RESTART_TRIES):  # and every crashed trainer restarted (a refused one again)
        if not swarm.trainer_set.down:
            break
        sim.run_for(scenario.trainer_restart_s)
    # an authorized run: a refresh window a fault covered may still end in a lost credential
    # (the node exits, as it should); let that happen before the checking rounds, not in them
    running = [swarm.workers[i] for i in swarm.live()]
    running += [t for i, t in enumerate(swarm.trainers) if i not in swarm.trainer_set.down]
    for _ in range(CREDENTIAL_TRIES):
        if swarm.nodes.credentials_settled(running):
            break
        sim.run_for(CREDENTIAL_WAIT_S)
    for trainer in swarm.trainers:
        trainer.request_stop()
    violations: list[str] = []
    seen: dict = {}
    tasks = [t for t in swarm.train_tasks if not t.done()]
    if tasks:
        sim.run(asyncio.wait(tasks, timeout=DRAIN_LIMIT_S))
    for index, task in enumerate(swarm.train_tasks):
        if not task.done():
            violations.append(
                f"trainer {index} did not finish its samples within {DRAIN_LIMIT_S:g} s of stopping"
            )
        elif not task.cancelled() and task.exception() is not None:
            violations.append(f"trainer {index} failed: {task.exception()!r}")
    logs = [completed_ids(swarm.folder / f"losses-{index}.jsonl") for index in range(len(swarm.trainers))]
    for index, trainer in enumerate(swarm.trainers):
        c = trainer.counters
        lost = c.dispatched - c.completed - c.in_flight - c.requeued
        if lost:
            violations.append(f"trainer {index}: {lost} sample(s) lost (taken, never completed nor requeued)")
        twice = sum(count - 1 for count in logs[index].values() if count > 1)
        if twice:
            violations.append(f"trainer {index} completed {twice} sample(s) twice")
    violations += swarm.trainer_set.check_left_behind(logs)
    seen["crashed_trainers_held"] = len(swarm.trainer_set.left_behind)
    seen["across_trainers_twice"] = completed_across(logs)
    violations += _check_agreement(swarm, seen)
    violations += _check_bounds(swarm)
    return violations, seen


def completed_ids(path: Path) -> collections.Counter:
    """How often each sample id stands in one trainer's loss log."""
    if not path.exists():
        return collections.Counter()
    return collections.Counter(str(json.loads(line)["id"]) for line in path.read_text().splitlines() if line)


def completed_twice(path: Path) -> int:
    """Sample ids one trainer's loss log holds more than once."""
    return sum(count - 1 for count in completed_ids(path).values() if count > 1)


def completed_across(logs: list[collections.Counter]) -> int:
    """Sample ids completed by more than one trainer: trainers coordinate shards through the
    DHT, and two opening one shard together, or one cut off long enough, both read some of it
    (reported, not a violation)."""
    owners = collections.Counter(sample_id for ids in logs for sample_id in ids)
    return sum(1 for count in owners.values() if count > 1)


def _check_agreement(swarm: _Swarm, seen: dict) -> list[str]:
    """More rounds among each stage's live, averaging replicas; after a clean one with no
    optimizer step during it (a stage's last batch may still step, from its progress: the
    delta rule keeps that step, and then the replicas differ by it) they must agree."""
    seen["final_rounds"] = seen["agreed_stages"] = 0
    if not swarm.scenario.averaging:
        return []
    groups = {}
    for stage in range(swarm.scenario.stages):
        # the stage's replicas: state in place (a joiner still downloading, or still in an
        # authorized run's queue, holds none yet, and may yet be refused and exit), and a
        # credential (one that lost it is on its way out: the others no longer talk to it)
        members = [
            i
            for i in swarm.live(stage)
            if swarm.workers[i].ready
            and swarm.workers[i].phases.phase.averages
            and swarm.workers[i].admission.valid
        ]
        if len(members) >= 2:
            groups[stage] = members
    _finish_rounds(swarm)  # a round the run started: let it end first
    seen["final_rounds"] = len(groups)
    violations = []
    for stage, members in groups.items():
        for attempt in range(FINAL_ATTEMPTS):
            outcome = _final_round(swarm, stage, members, FINAL_ROUND + attempt)
            if outcome != "stepped":
                break
        if outcome == "agreed":
            seen["agreed_stages"] += 1
        elif outcome != "stepped":  # stepped every time: left unchecked, counted as not agreed
            violations.append(outcome)
    return violations


def _final_round(swarm: _Swarm, stage: int, members: list[int], index: int) -> str:
    """One round of ``members``: "agreed", "stepped" (a replica stepped during it), or what
    went wrong."""
    sim = swarm.sim
    rounds = {}
    for i in members:
        with swarm.hosts[i].active():
            rounds[i] = sim.loop.create_task(swarm.workers[i].averager.run_round(index))
    sim.run(asyncio.wait(list(rounds.values()), timeout=ROUND_LIMIT_S))
    reports = []
    for i, task in rounds.items():
        if not task.done() or task.cancelled() or task.exception() is not None:
            return f"stage {stage}: worker {i}'s round {index} did not end ({task!r})"
        reports.append(task.result())
    if not all(r.group_size == len(members) and r.averaging_success == 1.0 for r in reports):
        shapes = [(r.group_size, round(r.averaging_success, 3), r.excluded) for r in reports]
        return f"stage {stage}: a round without faults was not clean: {shapes} of {len(members)}"
    if any(r.steps_during for r in reports):
        return "stepped"
    averager = swarm.workers[members[0]].averager
    ranges = averager.layout.ranges(reports[0].segment)
    values = [swarm.workers[i].averager.flat.read(ranges) for i in members]
    scale = 1.0 + max(float(np.abs(v).max()) if v.size else 0.0 for v in values)
    worst = max(float(np.abs(v - values[0]).max()) if v.size else 0.0 for v in values)
    if worst > AGREE_TOLERANCE * scale:
        return f"stage {stage}: replicas differ by {worst:.3g} after a clean round with no step during it"
    return "agreed"


def _finish_rounds(swarm: _Swarm) -> None:
    """Let the live workers' running averaging rounds end (each has its own deadline). One
    round's end may start a peer's next (its progress poke), so look again, a few times."""
    started = swarm.sim.elapsed_s
    for _ in range(FINAL_ATTEMPTS + 2):
        running = [swarm.workers[i].averager.round_task for i in swarm.live()]
        running = [t for t in running if t is not None and not t.done()]
        left_s = ROUND_LIMIT_S - (swarm.sim.elapsed_s - started)
        if not running or left_s <= 0:
            return
        swarm.sim.run(asyncio.wait(running, timeout=left_s))


def _check_bounds(swarm: _Swarm) -> list[str]:
    # A step during the checking rounds (a stage's last batch) starts a round of its own at a
    # cadence of one step: its reductions are open until it ends, which bounds them.
    _finish_rounds(swarm)
    violations = []
    # a restart keeps its id; the seed, and the builder's own (an authorized run's authorizer)
    ever = len(swarm.workers) + len(swarm.members) + len(swarm.trainers) + 1 + swarm.nodes.own_members
    for i in swarm.live():
        worker = swarm.workers[i]
        if worker.runtime.queued_samples:
            violations.append(
                f"worker {i}: {worker.runtime.queued_samples} samples queued with no trainer left"
            )
        if worker.averager.board.running():
            violations.append(f"worker {i}: {len(worker.averager.board.running())} reductions still open")
        if worker.dht.table is None:  # an authorized joiner still in the queue: holds nothing
            continue
        known = len(worker.dht.table.known())
        if known > ever:
            violations.append(f"worker {i} knows {known} DHT members of {ever} that ever existed")
    return violations
