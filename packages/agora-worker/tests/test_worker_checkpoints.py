"""Workers writing checkpoints: every N steps and on a clean stop, in the background, a failed
write never fatal; and a worker process killed with SIGKILL and restarted with --resume
continues from its newest checkpoint: its step is the checkpoint's, its weights (untrained
ones too) are the checkpoint's bit for bit, and it trains on from there."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import threading

import numpy as np
import pytest
import structlog

from agora_core.config import CheckpointConfig, load_run_config, parse_run_config
from agora_core.dht import BlockingDht
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient
from agora_core.schema import StageProgress, parse_entries, stage_progress_key
from agora_devkit.processes import spawn_python, wait_until, wait_until_async
from agora_devkit.runs import tiny_run_toml
from agora_worker.model import build_stage
from agora_worker.settings import WorkerSettings
from agora_worker.state.checkpoint import CheckpointStore, find_manifests
from agora_worker.state.snapshot import StateSnapshot
from agora_worker.worker import Worker

STARTUP_S = 90  # torch imports on a busy machine
# dummy_parameters: untrained, random per process: only a restored checkpoint matches
CONFIG = tiny_run_toml(
    "resume",
    seed=7,
    stages=2,
    optimizer={"target_batch_size": 2, "warmup_steps": 1},
    averaging={"enabled": False},
    checkpoint={"every_steps": 2, "keep": 2},
    **{"model.surrogate": {"dummy_parameters": 16}},
)


async def _call(address: str, method: str, meta=None, tensors=None):
    async with RpcClient() as client:
        return await client.call(address, method, meta, tensors, timeout_s=10)


def call(address: str, method: str, meta=None, tensors=None):
    return asyncio.run(_call(address, method, meta, tensors))


def info(address: str) -> dict:
    return call(address, "worker.info").meta


def parameters(address: str) -> np.ndarray:
    return np.array(call(address, "worker.parameters").tensors["values"])


def train_one_step(address: str, step: int) -> None:
    """Two samples through the head's backward: the stage's batch, so the worker steps."""
    rng = np.random.default_rng(step)
    for _ in range(2):
        tokens = rng.integers(0, 256, (1, 8), dtype=np.int64)
        grad = rng.standard_normal((1, 8, 4)).astype(np.float32)
        call(address, "backward", {"stage": 0}, {"tokens": tokens, "grad": grad})
    wait_until(lambda: info(address)["step"] == step, what=f"step {step}", timeout_s=20, every_s=0.05)


def flat_parameters(run, snapshot: StateSnapshot) -> np.ndarray:
    """The snapshot's weights in ``worker.parameters`` order: trained ones, then untrained."""
    named = list(build_stage(run, 0).named_parameters())
    order = [n for n, p in named if p.requires_grad] + [n for n, p in named if not p.requires_grad]
    return np.concatenate([snapshot.tensors[f"param/{n}"].ravel() for n in order])


RUN = parse_run_config(CONFIG)


@pytest.fixture
async def make_worker(tmp_path):
    started: list[Worker] = []

    async def make(**settings) -> Worker:
        defaults = dict(device="cpu", progress_interval_s=0.05, checkpoint_dir=str(tmp_path / "ckpt"))
        worker = Worker(
            run=dataclasses.replace(RUN, checkpoint=CheckpointConfig(every_steps=2, keep=10)),
            stage=0,
            key=NodeKey.generate(),
            settings=WorkerSettings(**{**defaults, **settings}),
        )
        started.append(worker)
        await worker.start()
        return worker

    yield make
    await asyncio.gather(*(w.stop(grace_s=5) for w in started), return_exceptions=True)


def metric(worker: Worker, name: str) -> float | None:
    return worker.metrics.sample_value(name)


async def test_a_worker_checkpoints_every_n_steps_and_once_more_on_a_clean_stop(make_worker):
    worker = await make_worker()
    for _ in range(3):
        await worker.take_step()
        await wait_until_async(lambda: not worker.checkpoint_writer.writing, what="the write to finish")
    assert [m.step for m in find_manifests(worker.checkpoint_writer.store.directory)] == [2]
    assert metric(worker, "agora_worker_checkpoint_step") == 2
    await worker.stop(grace_s=5)
    assert [m.step for m in find_manifests(worker.checkpoint_writer.store.directory)] == [
        3,
        2,
    ]  # written on stop
    assert metric(worker, "agora_worker_checkpoints_total") == 2
    assert metric(worker, "agora_worker_checkpoint_step") == 3


async def test_a_failed_write_is_logged_and_counted_and_training_goes_on(make_worker):
    worker = await make_worker()
    directory = worker.checkpoint_writer.store.directory
    shutil.rmtree(directory)
    directory.write_text("a file where the checkpoint directory was: every write fails")
    with structlog.testing.capture_logs() as logs:
        await worker.take_step()
        await worker.take_step()
        await wait_until_async(lambda: not worker.checkpoint_writer.writing, what="the write to fail")
    await worker.take_step()
    assert worker.optimizer.step == 3
    assert metric(worker, "agora_worker_checkpoint_failures_total") == 1
    assert metric(worker, "agora_worker_checkpoints_total") == 0
    assert any(e["event"] == "checkpoint_failed" and "Error" in e["error"] for e in logs)


async def test_a_checkpoint_that_comes_due_during_a_slow_write_is_skipped(make_worker, monkeypatch):
    worker = await make_worker()
    store_save = worker.checkpoint_writer.store.save
    release = threading.Event()

    def slow_save(snapshot, **kwargs):
        assert release.wait(timeout=20), "the test never released the write"
        return store_save(snapshot, **kwargs)

    monkeypatch.setattr(worker.checkpoint_writer.store, "save", slow_save)
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            await worker.take_step()
    assert worker.checkpoint_writer.writing  # step 2's write still going when step 4 came due
    assert any(e["event"] == "checkpoint_skipped_busy" and e["step"] == 4 for e in logs)
    release.set()
    await wait_until_async(lambda: not worker.checkpoint_writer.writing, what="the write to finish")
    assert [m.step for m in find_manifests(worker.checkpoint_writer.store.directory)] == [2]


async def test_resume_without_a_valid_checkpoint_starts_fresh(make_worker):
    worker = await make_worker(resume=True)
    assert worker.checkpoint_writer.resumed_step is None and worker.optimizer.step == 0


def test_resume_needs_a_checkpoint_dir():
    with pytest.raises(ConfigError, match="resume: needs a checkpoint_dir"):
        WorkerSettings(resume=True)


@pytest.mark.slow
@pytest.mark.timeout(2 * STARTUP_S + 120, func_only=True)
def test_a_killed_worker_restarted_with_resume_continues_from_its_checkpoint(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(CONFIG)
    run = load_run_config(config)
    assert run == RUN
    checkpoints = tmp_path / "checkpoints"
    seed = BlockingDht(key=NodeKey.generate(), config=run.dht)
    try:
        seed.start()
        command = [
            *("-m", "agora_worker", "run", "--config", str(config), "--stage", "0"),
            *("--bootstrap", seed.address, "--key-file", str(tmp_path / "worker.key")),
            *("--device", "cpu", "--progress-interval", "0.05", "--log-format", "json"),
            *("--checkpoint-dir", str(checkpoints)),
        ]
        with spawn_python(command) as first:
            address = first.read_until("  serving    ", timeout_s=STARTUP_S)
            assert first.read_until("  checkpoint ", timeout_s=10).startswith(str(checkpoints))
            for step in range(1, 5):
                train_one_step(address, step)
                if step == 2:  # one write at a time: step 4's would be skipped while 2's still runs
                    wait_until(
                        lambda: (info(address)["checkpoint"] or {}).get("last_step") == 2,
                        what="the checkpoint of step 2",
                        every_s=0.05,
                    )
            wait_until(
                lambda: (info(address)["checkpoint"] or {}).get("last_step") == 4,
                what="the checkpoint of step 4",
                every_s=0.05,
            )
            live_at_4 = parameters(address)
            train_one_step(address, 5)  # past the checkpoint: this step is lost with the process

            def reported() -> list[int]:
                found = parse_entries(seed.get(stage_progress_key(run.name, 0)), StageProgress.from_value)
                return [r.step for r in found]

            # The report of step 5 goes out just after the step: killed before it lands, the
            # worker would leave step 4's, and the check below would test nothing.
            wait_until(lambda: reported() == [5], what="the report of step 5 in the DHT", every_s=0.05)
            first.kill()

        saved = CheckpointStore(checkpoints, run=run, stage=0, keep=2).newest_valid()
        assert saved is not None and saved.step == 4
        assert flat_parameters(run, saved).tobytes() == live_at_4.tobytes()

        # The dead worker's report (step 5) is still in the DHT: the restarted one, with the same
        # key, must not take it for the stage being ahead of it.
        assert reported() == [5]

        with spawn_python([*command, "--resume"]) as second:
            address = second.read_until("  serving    ", timeout_s=STARTUP_S)
            assert second.read_until("  resumed    ", timeout_s=10) == "step 4"
            resumed = info(address)
            assert resumed["step"] == 4 and resumed["checkpoint"]["resumed_step"] == 4
            assert parameters(address).tobytes() == flat_parameters(run, saved).tobytes()
            train_one_step(address, 5)  # training goes on from the checkpoint's step
            assert info(address)["last_step"]["applied"]
    finally:
        seed.stop()
