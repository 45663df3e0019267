"""A trainer against real worker processes on 127.0.0.1 (surrogate stages).

One swarm for the module, living through a run's life in order: samples complete through
three stages; the faster of two workers in a stage does about three times the work; every
backward goes to its forward's worker; workers die during forwards and during backwards and
no sample is lost; a new worker starts receiving work. Then, separately: a trainer restarted
on the same shards neither repeats nor skips a sample.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest
import pytest_asyncio

from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_core.testing import ChildProcess, poll_until, spawn_python, wait_until_async
from agora_trainer.shards import make_shards
from agora_trainer.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

RUN_TOML = """
name = "trainer-test"
[model]
kind = "surrogate"
d_model = 32
n_heads = 2
subspace_rank = 4
vocab_size = 256
seq_len = 16
stage_layers = [1, 1, 1]
[model.surrogate]
forward_delay_s = 0.025
backward_delay_s = 0.025
[optimizer]
target_batch_size = 8
[dht]
gossip_period_s = 0.2
probe_timeout_s = 0.1
suspicion_timeout_s = 2.0
op_timeout_s = 2.0
[transport]
request_timeout_s = 10.0
"""
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
FAST = dict(refresh_interval_s=0.3, progress_interval_s=0.5, ban_s=30.0)


@dataclass
class Member:
    child: ChildProcess
    node_id: str
    address: str
    stage: int
    delay_scale: float


@dataclass
class Swarm:
    seed: DhtNode
    config_path: str
    shards: str
    tmp: object
    stack: contextlib.ExitStack
    client: RpcClient
    workers: list[Member]
    spawned: int = 0

    async def add_worker(self, stage: int, delay_scale: float = 1.0) -> Member:
        self.spawned += 1  # before any await: concurrent calls each get their own key file
        command = ["-m", "agora_worker", "run", "--config", self.config_path, "--stage", str(stage)]
        command += ["--bootstrap", self.seed.address, "--device", "cpu"]
        command += ["--key-file", str(self.tmp / f"worker-{self.spawned}.key")]
        command += ["--progress-interval", "0.1", "--announce-interval", "0.2"]
        command += ["--surrogate-delay-scale", str(delay_scale)]
        child = self.stack.enter_context(spawn_python(command, env={"AGORA_LOG_LEVEL": "warning"}))
        node_id = await asyncio.to_thread(child.read_until, "  node id    ")
        address = await asyncio.to_thread(child.read_until, "  serving    ")
        member = Member(child, node_id, address, stage, delay_scale)
        self.workers.append(member)
        return member

    async def info(self, member: Member) -> dict:
        return (await self.client.call(member.address, "worker.info", timeout_s=5)).meta

    def trainer(self, **settings) -> Trainer:
        return Trainer(
            run=load_run_config(self.config_path),
            shards_dir=self.shards,
            key=NodeKey.generate(),
            bootstrap=[self.seed.address],
            settings=TrainerSettings(**{**FAST, **settings}),
        )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainer")
    config = tmp / "run.toml"
    config.write_text(RUN_TOML)
    make_shards(tmp / "shards", shards=2, tokenizer=ByteTokenizer(), max_bytes=400_000)
    run = load_run_config(config)
    seed = DhtNode(key=NodeKey.generate(), config=run.dht)
    await seed.start()
    stack = contextlib.ExitStack()
    client = RpcClient()
    swarm = Swarm(seed, str(config), str(tmp / "shards"), tmp, stack, client, [])
    try:
        # Stage 1 is the bottleneck: its workers take 50 ms and 150 ms per sample (compute, not
        # the ~ms of RPC overhead, decides their share), head and tail 10 ms.
        await asyncio.gather(
            swarm.add_worker(0, 0.2),
            swarm.add_worker(1, 1.0),
            swarm.add_worker(1, 3.0),
            swarm.add_worker(2, 0.2),
        )
        yield swarm
    finally:
        await client.close()
        stack.close()
        await seed.stop()


def by_stage(swarm: Swarm, stage: int) -> list[Member]:
    return [m for m in swarm.workers if m.stage == stage and m.child.proc.poll() is None]


async def train_to_the_end(trainer: Trainer, timeout_s: float = 120):
    """Start, train until max_samples, close (even on failure); the counters."""
    await trainer.start()
    try:
        async with asyncio.timeout(timeout_s):
            return await trainer.train()
    finally:
        await trainer.close()


async def test_a_trainer_completes_its_samples_through_three_stages(swarm):
    trainer = swarm.trainer(lanes=8, max_samples=160, state_file=str(swarm.tmp / "run1.json"))
    counters = await train_to_the_end(trainer)
    assert counters.completed == 160 and counters.dispatched == 160 and counters.in_flight == 0
    assert counters.requeued == 0 and trainer.abandoned == 0
    assert len(set(trainer.completed_ids)) == 160
    assert trainer.loss_ema is not None and trainer.loss_ema < 5.6  # ln(256) ~ 5.55 at the start


async def test_the_faster_worker_of_a_stage_receives_about_three_times_the_samples(swarm):
    fast, slow = sorted(by_stage(swarm, 1), key=lambda m: m.delay_scale)
    served = [(await swarm.info(w))["processed_by_kind"].get("forward", 0) for w in (fast, slow)]
    assert served[1] > 0
    assert 2.4 <= served[0] / served[1] <= 3.6, served


async def test_every_backward_went_to_the_worker_that_ran_its_forward(swarm):
    for member in by_stage(swarm, 0) + by_stage(swarm, 1):
        done = (await swarm.info(member))["processed_by_kind"]
        assert done.get("forward", 0) == done.get("backward", 0) > 0, (member.stage, done)


def lane_busy_with(trainer: Trainer, worker: Member, method: str) -> bool:
    return any(lane.worker == worker.node_id and lane.method == method for lane in trainer.lanes)


async def test_killed_workers_lose_no_sample_and_a_new_worker_gets_work(swarm):
    trainer = swarm.trainer(lanes=8, max_samples=240, state_file=str(swarm.tmp / "run2.json"))
    await trainer.start()
    training = asyncio.create_task(trainer.train())
    try:
        fast, slow = sorted(by_stage(swarm, 1), key=lambda m: m.delay_scale)
        # 1. a worker dies while a lane waits on its forward
        await wait_until_async(
            lambda: lane_busy_with(trainer, slow, "forward"),
            timeout_s=30,
            what="a forward on the slow worker",
        )
        slow.child.kill()
        counters = trainer.counters
        assert counters.completed + counters.in_flight + counters.requeued == counters.dispatched
        # 2. a newcomer joins the stage and is given work
        newcomer = await swarm.add_worker(1)

        async def newcomer_has_work() -> bool:
            return (await swarm.info(newcomer))["processed"] > 0

        await poll_until(newcomer_has_work, timeout_s=30, what="the newcomer to get work")
        # 3. a worker dies while a lane waits on its backward
        await wait_until_async(
            lambda: lane_busy_with(trainer, fast, "backward"),
            timeout_s=30,
            what="a backward on the fast worker",
        )
        fast.child.kill()
        assert counters.completed + counters.in_flight + counters.requeued == counters.dispatched
        async with asyncio.timeout(120):
            await training
    finally:
        training.cancel()
        await asyncio.gather(training, return_exceptions=True)
        await trainer.close()
    assert counters.completed == counters.dispatched == 240 and counters.in_flight == 0
    assert counters.requeued == 0 and trainer.abandoned == 0  # retried, never dropped
    assert counters.retries >= 1 and counters.fallbacks >= 1  # a backward lost its forward's worker
    assert len(set(trainer.completed_ids)) == 240


async def test_a_restarted_trainer_resumes_without_repeating_or_skipping(swarm):
    state = str(swarm.tmp / "resume.json")
    first = swarm.trainer(lanes=4, max_samples=40, state_file=state)
    await train_to_the_end(first, timeout_s=60)
    second = swarm.trainer(lanes=4, max_samples=40, state_file=state)
    await train_to_the_end(second, timeout_s=60)
    both = first.completed_ids + second.completed_ids
    assert len(both) == len(set(both)) == 80  # nothing twice
    assert sorted(both) == list(range(80))  # nothing skipped
