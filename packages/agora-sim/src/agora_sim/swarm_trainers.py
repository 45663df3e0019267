"""The trainers of a simulated swarm: started in batches, crashed, restarted on their state files.

A trainer crash (``[swarm] trainer_crashes_per_min``) kills the trainer's process wherever it
is: lanes mid call, a completion half recorded, a shard claim half published. After
``trainer_restart_s`` it comes back as an operator's supervisor brings it back: the same key
(the same node id rejoins the DHT), the same state file and loss log, a new process on a new
host. What must hold is what the trainer promises (``agora_trainer.data.cursor``): the restart
repeats no completed sample and skips none. Each sample a crashed incarnation held (in
flight, or handed back to run again) is completed afterwards by a trainer of the run, or still
held by one (its shard open there, the sample not done) when the run ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from agora_core.admission.join_client import AdmissionRefused
from agora_trainer.routing import Counters
from agora_trainer.trainer import Trainer, TrainerSettings

if TYPE_CHECKING:
    from collections import Counter

    from agora_sim.swarm import _Swarm


class SwarmTrainers:
    def __init__(self, swarm: _Swarm):
        self.swarm = swarm
        self.nodes: list[Trainer] = []  # each index's current incarnation
        self.hosts: list = []
        self.tasks: list[asyncio.Task] = []  # each index's training (start-up and lanes)
        self.shards: Path | None = None
        self.down: set[int] = set()  # crashed, not restarted yet
        self.retired: list[Counters] = []  # the crashed incarnations' counters
        self.left_behind: set[int] = set()  # sample ids a crashed incarnation held
        self.crashes = 0
        self.restarts = 0
        self.refused = 0  # restarts an authorized run's authorizer refused

    def _new(self, index: int, *, restart: bool = False) -> tuple[Trainer, object]:
        swarm = self.swarm
        host = swarm.host(f"trainer-{index}" + (f"r{self.restarts}" if restart else ""))
        settings = TrainerSettings(
            lanes=swarm.scenario.lanes,
            state_file=str(swarm.folder / f"trainer-{index}.json"),
            loss_log=str(swarm.folder / f"losses-{index}.jsonl"),
        )
        with host.active():
            key = self.nodes[index].key if restart else swarm.sim.key()
            trainer = swarm.nodes.trainer(key, self.shards, settings)  # an authorized one rejoins
        return trainer, host

    def start(self, shards: Path) -> None:
        """The scenario's trainers, ``start_batch`` at a time, each training once it is up."""
        self.shards = shards
        swarm, count, batch = self.swarm, self.swarm.scenario.trainers, self.swarm.scenario.start_batch
        for first in range(0, count, batch):
            group = [self._new(index) for index in range(first, min(first + batch, count))]
            starts = [swarm._start(trainer, host) for trainer, host in group]
            swarm.sim.run(starts[0] if len(starts) == 1 else asyncio.gather(*starts))
            for trainer, host in group:
                with host.active():
                    self.tasks.append(swarm.sim.loop.create_task(trainer.train()))
                self.nodes.append(trainer)
                self.hosts.append(host)

    def crash(self, index: int) -> None:
        """Trainer ``index``'s process dies now; it restarts ``trainer_restart_s`` later."""
        self.crashes += 1
        self._exit(index)

    def _exit(self, index: int) -> None:
        trainer = self.nodes[index]
        self.left_behind.update(trainer.cursor.outstanding())
        self.retired.append(trainer.counters)
        self.down.add(index)
        self.swarm.sim.network.kill(self.hosts[index])
        self.swarm.sim.loop.call_later(self.swarm.scenario.trainer_restart_s, self._restart, index)

    def _restart(self, index: int) -> None:
        trainer, host = self._new(index, restart=True)
        self.restarts += 1
        self.nodes[index], self.hosts[index] = trainer, host
        self.down.discard(index)
        with host.active():
            self.tasks[index] = self.swarm.sim.loop.create_task(self._run(trainer))

    async def _run(self, trainer: Trainer) -> Counters | None:
        try:
            await self.swarm.nodes.start(trainer)
        except AdmissionRefused:  # the authorizer could not dial it back through a fault:
            self.refused += 1  # the process exits, and its supervisor starts it again
            self.swarm.sim.loop.call_soon(self._exit, self.nodes.index(trainer))
            return None
        return await trainer.train()

    def completed(self) -> int:
        return sum(c.completed for c in self.retired) + sum(t.counters.completed for t in self.nodes)

    def check_left_behind(self, logs: list[Counter]) -> list[str]:
        """The crashed incarnations' samples that no trainer completed and none holds now."""
        done = set().union(*logs) if logs else set()
        skipped = sorted(
            sample_id
            for sample_id in self.left_behind
            if str(sample_id) not in done and not any(t.cursor.holds(sample_id) for t in self.nodes)
        )
        if not skipped:
            return []
        return [
            f"{len(skipped)} sample(s) a crashed trainer held were skipped after its restart "
            f"(neither completed nor held by any trainer): {skipped[:5]}"
        ]
