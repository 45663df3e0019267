"""A trainer against real worker processes on 127.0.0.1 (surrogate stages).

Samples complete through three stages; the faster of two workers in a stage gets clearly
more of the work; every backward goes to its forward's worker; a trainer restarted on the same
shards neither repeats nor skips a sample. These share one swarm of workers they never harm:
each runs its own trainer and reads the workers' counters before and after it. The test that
kills workers mid-forward and mid-backward (and adds a newcomer) starts a swarm of its own.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio

from agora_core.config import load_run_config
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_devkit.processes import ChildProcess, poll_until, spawn_python, wait_until_async
from agora_devkit.runs import tiny_run_toml
from agora_trainer.data.cursor import reading_order
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.shards import open_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

# A worker added mid-test serves at once ([sync] stale_after_steps): these tests are about
# routing, not joining (a newcomer more than 20 steps behind would download and spend 400
# steps invisible, which on a loaded machine outlasts a test's samples: agora-worker's tests
# cover joining).
RUN_TOML = tiny_run_toml(
    "trainer-test",
    seq_len=16,
    dht={"op_timeout_s": 2.0},
    optimizer={"target_batch_size": 8},
    transport={"request_timeout_s": 10.0},
    sync={"stale_after_steps": 100000},
    **{"model.surrogate": {"forward_delay_s": 0.025, "backward_delay_s": 0.025}},
)
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]
FAST = dict(refresh_interval_s=0.3, progress_interval_s=0.5, ban_s=30.0)
# (stage, surrogate delay scale). Stage 1 is the bottleneck: its workers take 50 ms and 150 ms
# per sample (compute, not the ~ms of RPC overhead, decides their share), head and tail 10 ms.
THREE_STAGES = [(0, 0.2), (1, 1.0), (1, 3.0), (2, 0.2)]


@dataclass
class Member:
    child: ChildProcess
    node_id: str
    address: str
    stage: int
    delay_scale: float
    program: tuple[str, ...] = ("agora_worker",)


@dataclass
class Swarm:
    seed: DhtNode
    config_path: str
    shards: str
    tmp: Path
    stack: contextlib.ExitStack
    client: RpcClient
    workers: list[Member]
    spawned: int = 0

    async def add_worker(
        self, stage: int, delay_scale: float = 1.0, program: tuple[str, ...] = ("agora_worker",)
    ) -> Member:
        """``program``: the module and its first arguments (``agora_devkit.attacker`` and a lie)."""
        self.spawned += 1  # before any await: concurrent calls each get their own key file
        command = ["-m", *program, "run", "--config", self.config_path, "--stage", str(stage)]
        command += ["--bootstrap", self.seed.address, "--device", "cpu"]
        command += ["--key-file", str(self.tmp / f"worker-{self.spawned}.key")]
        command += ["--progress-interval", "0.1", "--announce-interval", "0.2"]
        command += ["--surrogate-delay-scale", str(delay_scale)]
        child = self.stack.enter_context(spawn_python(command, env={"AGORA_LOG_LEVEL": "warning"}))
        node_id = await asyncio.to_thread(child.read_until, "  node id    ")
        address = await asyncio.to_thread(child.read_until, "  serving    ")
        member = Member(child, node_id, address, stage, delay_scale, tuple(program))
        self.workers.append(member)
        return member

    async def info(self, member: Member) -> dict:
        return (await self.client.call(member.address, "worker.info", timeout_s=5)).meta

    async def served(self, member: Member) -> collections.Counter[str]:
        """The samples ``member`` has computed so far, by op (forward, backward, ...)."""
        return collections.Counter((await self.info(member))["processed_by_op"])

    def trainer(self, shards: Path | None = None, **settings) -> Trainer:
        return Trainer(
            run=load_run_config(self.config_path),
            shards_dir=shards or self.shards,
            key=NodeKey.generate(),
            bootstrap=[self.seed.address],
            settings=TrainerSettings(**{**FAST, **settings}),
        )


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Read-only training data, shared by every swarm of the module."""
    out = tmp_path_factory.mktemp("shards")
    make_shards(out, shards=2, tokenizer=ByteTokenizer(), max_bytes=400_000)
    return out


@contextlib.asynccontextmanager
async def running_swarm(tmp: Path, shards: Path, workers: list[tuple]) -> AsyncIterator[Swarm]:
    """A DHT seed in this process and ``workers`` (stage, delay scale[, program]: see
    ``Swarm.add_worker``), started in parallel; every process is stopped when the block exits,
    whatever happened inside it."""
    config = tmp / "run.toml"
    config.write_text(RUN_TOML)
    async with contextlib.AsyncExitStack() as cleanup:  # on exit, each step runs even if one fails
        seed = DhtNode(key=NodeKey.generate(), config=load_run_config(config).dht)
        await seed.start()
        cleanup.push_async_callback(seed.stop)
        children = cleanup.enter_context(contextlib.ExitStack())  # stops any worker left running
        client = RpcClient()
        cleanup.push_async_callback(client.close)
        swarm = Swarm(seed, str(config), str(shards), tmp, children, client, [])
        cleanup.push_async_callback(stop_side_by_side, swarm.workers)
        await asyncio.gather(*(swarm.add_worker(*worker) for worker in workers))
        yield swarm


async def stop_side_by_side(workers: list[Member]) -> None:
    """Each worker takes a moment to leave the swarm: stop them all at once."""
    await asyncio.gather(*(asyncio.to_thread(m.child.stop) for m in workers))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def swarm(tmp_path_factory, shards):
    """Three stages, two workers of different speeds in stage 1. Tests only train against it:
    none kills, adds or slows a worker, and each measures the counters its own trainer moved."""
    async with running_swarm(tmp_path_factory.mktemp("trainer"), shards, THREE_STAGES) as swarm:
        yield swarm


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


async def test_a_trainer_completes_its_samples_through_three_stages(swarm, tmp_path):
    trainer = swarm.trainer(lanes=8, max_samples=160, state_file=str(tmp_path / "run.json"))
    counters = await train_to_the_end(trainer)
    assert counters.completed == 160 and counters.dispatched == 160 and counters.in_flight == 0
    assert counters.requeued == 0 and trainer.abandoned == 0
    assert len(set(trainer.completed_ids)) == 160
    assert trainer.loss_ema is not None and trainer.loss_ema < 5.6  # ln(256) ~ 5.55 at the start


async def test_the_faster_worker_of_a_stage_receives_clearly_more_samples(swarm, tmp_path):
    # Three times as fast; test_balancer proves the 3x share on a deterministic clock. Here,
    # against real processes on a shared machine, only a margin no noise crosses is asserted.
    fast, slow = sorted(by_stage(swarm, 1), key=lambda m: m.delay_scale)
    before = [(await swarm.served(w))["forward"] for w in (fast, slow)]
    trainer = swarm.trainer(lanes=8, max_samples=160, state_file=str(tmp_path / "run.json"))
    await train_to_the_end(trainer)
    after = [(await swarm.served(w))["forward"] for w in (fast, slow)]
    to_fast, to_slow = after[0] - before[0], after[1] - before[1]
    assert to_fast + to_slow >= 160  # every sample went through one of them (a retry: twice)
    assert to_slow > 0, (to_fast, to_slow)  # the slow one is used, not starved
    assert to_fast >= 1.5 * to_slow, (to_fast, to_slow)


async def test_every_backward_goes_to_the_worker_that_ran_its_forward(swarm, tmp_path):
    members = by_stage(swarm, 0) + by_stage(swarm, 1)
    before = [await swarm.served(m) for m in members]
    # no spot checks: a check is a forward with no backward, by design
    trainer = swarm.trainer(
        lanes=8, max_samples=80, state_file=str(tmp_path / "run.json"), spot_check_fraction=0.0
    )
    counters = await train_to_the_end(trainer)
    assert counters.completed == 80 and counters.retries == 0  # no fallback could blur the check
    for member, was in zip(members, before, strict=True):
        done = await swarm.served(member)
        forwards, backwards = done["forward"] - was["forward"], done["backward"] - was["backward"]
        assert forwards == backwards > 0, (member.stage, member.delay_scale, forwards, backwards)


async def test_a_lane_carries_its_microbatch_through_every_stage_in_one_request_per_hop(swarm, tmp_path):
    members = [m for stage in range(3) for m in by_stage(swarm, stage)]
    before = [await swarm.served(m) for m in members]
    losses = tmp_path / "losses.jsonl"
    trainer = swarm.trainer(
        lanes=2,
        microbatch=4,
        max_samples=62,
        state_file=str(tmp_path / "run.json"),
        loss_log=str(losses),
        spot_check_fraction=0.0,  # a check is one more forward, by design: counted elsewhere
    )
    counters = await train_to_the_end(trainer)
    assert counters.completed == 62 and counters.retries == 0 and trainer.abandoned == 0
    logged = [json.loads(line)["id"] for line in losses.read_text().splitlines()]
    assert sorted(logged) == sorted(set(trainer.completed_ids)) and len(logged) == 62  # each its own loss
    for stage, method in ((0, "forward"), (1, "forward"), (2, "forward_backward"), (0, "backward")):
        calls = trainer.metrics.sample_value(
            "agora_trainer_hop_seconds_count", {"to_stage": str(stage), "method": method}
        )
        assert calls == 16, (stage, method, calls)  # 15 microbatches of 4 and the last 2 samples
    after = [await swarm.served(m) for m in members]
    moved_1 = [
        done["forward"] - was["forward"]
        for m, was, done in zip(members, before, after, strict=True)
        if m.stage == 1
    ]
    assert sum(moved_1) == 62  # every sample once through stage 1


def lane_busy_with(trainer: Trainer, worker: Member, method: str) -> bool:
    return any(lane.worker == worker.node_id and lane.method == method for lane in trainer.lanes)


# Its own swarm (4 workers, up to 30 s each to start, in parallel), a newcomer (up to 60 s),
# three waits of 30 s and 120 s of training: more than the suite's 180 s default.
@pytest.mark.timeout(360)
async def test_killed_workers_lose_no_sample_and_a_new_worker_gets_work(tmp_path, shards):
    async with running_swarm(tmp_path, shards, THREE_STAGES) as swarm:
        # More samples than the test needs: it stops the trainer once the newcomer alone has
        # carried stage 1 a while, however long the newcomer took to start on this machine.
        trainer = swarm.trainer(lanes=8, max_samples=5000, state_file=str(tmp_path / "run.json"))
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
            at_kill = counters.completed
            await wait_until_async(
                lambda: counters.completed >= at_kill + 40,
                timeout_s=60,
                what="samples through the newcomer alone",
            )
            trainer.request_stop()
            async with asyncio.timeout(120):
                await training
        finally:
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
            await trainer.close()
    assert counters.completed == counters.dispatched and counters.in_flight == 0
    assert counters.requeued == 0 and trainer.abandoned == 0  # retried, never dropped
    assert counters.retries >= 1 and counters.fallbacks >= 1  # a backward lost its forward's worker
    assert len(set(trainer.completed_ids)) == counters.completed


async def test_a_worker_process_computing_garbage_is_caught_by_spot_checks_and_accused_alone(
    tmp_path, shards
):
    """Three stage-1 replicas, one of them ``agora_devkit.attacker garbage`` (random outputs and
    returned gradients of their own RMS, once it served 4 forwards honestly): a trainer checking
    every hop settles mismatches against it alone, finishes every sample, and accuses it,
    never an honest one."""
    garbage = (1, 0.2, ("agora_devkit.attacker", "garbage@+4"))
    async with running_swarm(tmp_path, shards, [(0, 0.2), (1, 0.2), (1, 0.2), garbage, (2, 0.2)]) as swarm:
        [liar] = [m for m in swarm.workers if m.program == garbage[2]]
        trainer = swarm.trainer(
            lanes=4, max_samples=64, state_file=str(tmp_path / "run.json"), spot_check_fraction=1.0
        )
        counters = await train_to_the_end(trainer)
    assert counters.completed == 64 and trainer.abandoned == 0
    assert set(trainer.router.spot.accused) == {liar.node_id}
    assert (
        trainer.router.checks.mismatches >= 3
        and trainer.router.spot.failures(liar.node_id) == trainer.router.checks.mismatches
    )
    gradient_checks = sum(
        trainer.metrics.sample_value(
            "agora_trainer_spot_checks_total", {"to_stage": "1", "kind": "gradient", "outcome": outcome}
        )
        or 0
        for outcome in ("learning", "agreed", "mismatch", "unresolved")
    )
    assert gradient_checks >= 1  # backwards were asked again too, as ``gradient``


async def test_a_restarted_trainer_resumes_without_repeating_or_skipping(swarm, tmp_path):
    # Shards of its own: the module's other trainers leave claims on theirs (shard rotation)
    mine = tmp_path / "shards"
    make_shards(mine, shards=2, tokenizer=ByteTokenizer(), max_bytes=100_000)
    state = str(tmp_path / "resume.json")
    first = swarm.trainer(lanes=4, max_samples=40, state_file=state, shards=mine)
    await train_to_the_end(first, timeout_s=60)
    second = swarm.trainer(lanes=4, max_samples=40, state_file=state, shards=mine)
    await train_to_the_end(second, timeout_s=60)
    both = first.completed_ids + second.completed_ids
    assert len(both) == len(set(both)) == 80  # nothing twice
    assert sorted(both) == sorted(reading_order(open_shards(mine), 16, 0, 80))  # nothing skipped
