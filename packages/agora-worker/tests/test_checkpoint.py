"""Checkpoints on real files: bit-exact round trips, keep-K pruning, every kind of bad
checkpoint skipped (with a warning naming it) in favour of the newest good one, and the
writer's standing recorded in the manifest as it stood when the snapshot was captured."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json

import numpy as np
import pytest
import structlog
import torch

from agora_core.config import RunConfig
from agora_core.config.run import ModelConfig, OptimizerConfig, parse_run_config
from agora_core.observability.metrics import NodeMetrics
from agora_devkit.processes import wait_until_async
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.state import checkpoint as checkpoint_module
from agora_worker.state.checkpoint import (
    CheckpointInvalid,
    CheckpointStore,
    config_digest,
    find_manifests,
    read_manifest,
)
from agora_worker.state.checkpoint_writer import CheckpointWriter
from agora_worker.state.snapshot import StageState, StateSnapshot

MODEL = ModelConfig(
    d_model=32, n_heads=2, mlp_ratio=2.0, subspace_rank=4, vocab_size=256, seq_len=8, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="ckpt", seed=5, model=MODEL, optimizer=OptimizerConfig(warmup_steps=1))


def replica(run: RunConfig = RUN, stage: int = 1) -> StageState:
    module = build_stage(run, stage)
    optimizer = HostOptimizer(module, run.optimizer, clip_threshold=1.0)
    return StageState(module, optimizer)


def train(state: StageState, steps: int, seed: int = 0) -> None:
    """Take ``steps`` optimizer steps on random gradients (AdamW then holds moments)."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in state.optimizer.compute:
            p.grad = torch.randn(p.shape, generator=generator)
        state.optimizer.accumulate(1)
        state.optimizer.apply()


def snapshot_at(state: StageState, steps: int) -> StateSnapshot:
    train(state, steps, seed=state.optimizer.step)
    return state.capture()


def bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "ckpt", run=RUN, stage=1, keep=3)


def test_a_checkpoint_round_trips_bit_exact_and_installs_into_a_fresh_replica(store):
    state = replica()
    saved = snapshot_at(state, 2)
    assert any(name.startswith("adam/") for name in saved.tensors)  # the optimizer state too
    store.save(saved)
    loaded = store.newest_valid(check=state.check)
    assert loaded is not None and loaded.step == 2
    assert loaded.digests() == saved.digests()
    assert all(bits(loaded.tensors[n]) == bits(a) for n, a in saved.tensors.items())
    fresh = replica()
    fresh.install(loaded)
    again = fresh.capture()
    assert again.step == 2 and again.digests() == saved.digests()


def test_the_manifest_says_what_the_checkpoint_is(store):
    path = store.save(snapshot_at(replica(), 1))
    manifest = json.loads(path.read_text())
    assert manifest["format"] == "agora-checkpoint-v1"
    assert (manifest["run"], manifest["stage"], manifest["step"]) == ("ckpt", 1, 1)
    assert manifest["config_digest"] == config_digest(RUN)
    assert manifest["file_bytes"] == (path.parent / manifest["file"]).stat().st_size
    assert parse_run_config(manifest["run_config"]) == RUN
    assert all(len(d) == 64 for d in manifest["tensors"].values())


def test_only_the_newest_keep_checkpoints_stay_on_disk(tmp_path):
    store = CheckpointStore(tmp_path, run=RUN, stage=1, keep=2)
    state = replica()
    for _ in range(4):
        store.save(snapshot_at(state, 1))
    assert [m.step for m in find_manifests(tmp_path)] == [4, 3]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 4 and sum(n.endswith(".safetensors") for n in names) == 2
    assert store.newest_valid().step == 4


def test_another_runs_checkpoints_in_the_directory_neither_count_nor_go(tmp_path):
    old_run = dataclasses.replace(RUN, name="old")
    CheckpointStore(tmp_path, run=old_run, stage=1, keep=2).save(snapshot_at(replica(old_run), 50))
    store = CheckpointStore(tmp_path, run=RUN, stage=1, keep=2)
    state = replica()
    for _ in range(3):
        store.save(snapshot_at(state, 1))
    assert [(m.run, m.step) for m in find_manifests(tmp_path)] == [("old", 50), ("ckpt", 3), ("ckpt", 2)]
    assert len(list(tmp_path.glob("*.safetensors"))) == 3  # the old run's tensors stay with it
    assert store.newest_valid().step == 3


def newest_tensor_file(store: CheckpointStore):
    return find_manifests(store.directory)[0].tensor_path


def test_a_truncated_file_is_skipped_for_the_older_valid_one(store):
    state = replica()
    store.save(snapshot_at(state, 1))
    store.save(snapshot_at(state, 1))
    path = newest_tensor_file(store)
    path.write_bytes(path.read_bytes()[:-100])
    with structlog.testing.capture_logs() as logs:
        loaded = store.newest_valid()
    assert loaded.step == 1
    [warning] = [e for e in logs if e["event"] == "checkpoint_skipped"]
    assert "truncated" in warning["reason"] and path.name in warning["reason"]


def test_a_flipped_byte_is_caught_by_its_digest(store):
    state = replica()
    store.save(snapshot_at(state, 1))
    store.save(snapshot_at(state, 1))
    path = newest_tensor_file(store)
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # inside a tensor: the file still parses, one value changed
    path.write_bytes(bytes(data))
    with structlog.testing.capture_logs() as logs:
        loaded = store.newest_valid()
    assert loaded.step == 1
    assert any("digest mismatch" in e.get("reason", "") for e in logs)


def test_unreadable_files_are_skipped_with_their_reason(store):
    state = replica()
    store.save(snapshot_at(state, 1))
    store.save(snapshot_at(state, 1))
    (store.directory / "stage1-step000000009.json").write_text("{not json")
    path = newest_tensor_file(store)
    path.write_bytes(b"\xff" * path.stat().st_size)  # right size, garbage header
    with structlog.testing.capture_logs() as logs:
        loaded = store.newest_valid()
    assert loaded.step == 1
    reasons = [e["reason"] for e in logs if e["event"] == "checkpoint_skipped"]
    assert any("unreadable manifest" in r for r in reasons)
    assert any("unreadable" in r and path.name in r for r in reasons)


def test_checkpoints_of_another_stage_run_or_model_are_skipped(store):
    store.save(snapshot_at(replica(), 1))
    other_run = dataclasses.replace(RUN, name="other")
    other_seed = dataclasses.replace(RUN, seed=99)
    CheckpointStore(store.directory, run=RUN, stage=0, keep=3).save(snapshot_at(replica(stage=0), 5))
    CheckpointStore(store.directory, run=other_run, stage=1, keep=3).save(snapshot_at(replica(other_run), 6))
    CheckpointStore(store.directory, run=other_seed, stage=1, keep=3).save(
        snapshot_at(replica(other_seed), 7)
    )
    with structlog.testing.capture_logs() as logs:
        loaded = store.newest_valid()
    assert loaded.step == 1
    reasons = " | ".join(e["reason"] for e in logs if e["event"] == "checkpoint_skipped")
    assert "stage 0, not 1" in reasons
    assert "run 'other'" in reasons
    assert "another model or seed" in reasons


def test_a_checkpoint_of_another_model_shape_fails_the_replicas_check(store):
    store.save(snapshot_at(replica(), 1))
    wider = dataclasses.replace(RUN, model=dataclasses.replace(MODEL, d_model=64))
    with structlog.testing.capture_logs() as logs:
        assert store.newest_valid(check=replica(wider).check) is None
    assert any("another model shape" in e.get("reason", "") for e in logs)


def test_a_crash_between_tensors_and_manifest_leaves_the_previous_checkpoint_newest(store, monkeypatch):
    state = replica()
    store.save(snapshot_at(state, 1))

    def crash(path, manifest):
        raise OSError("simulated crash before the manifest")

    monkeypatch.setattr(checkpoint_module, "_write_manifest", crash)
    with pytest.raises(OSError, match="simulated crash"):
        store.save(snapshot_at(state, 1))
    monkeypatch.undo()
    assert len(list(store.directory.glob("*.safetensors"))) == 2  # the orphan is on disk
    assert store.newest_valid().step == 1
    store.save(snapshot_at(state, 1))  # step 3; the orphan of step 2 goes
    assert [m.step for m in find_manifests(store.directory)] == [3, 1]
    assert len(list(store.directory.glob("*.safetensors"))) == 2


def test_saving_the_same_step_again_replaces_it_safely(store):
    state = replica()
    first = snapshot_at(state, 1)
    store.save(first)
    with torch.no_grad():
        state.optimizer.master[0].add_(1.0)  # averaging moved the weights within the step
    second = state.capture()
    store.save(second)
    assert [m.step for m in find_manifests(store.directory)] == [1]
    assert store.newest_valid().digests() == second.digests()
    assert len(list(store.directory.glob("*.safetensors"))) == 1


def test_an_empty_directory_has_no_checkpoint(tmp_path):
    assert CheckpointStore(tmp_path / "new", run=RUN, stage=1, keep=1).newest_valid() is None


def test_the_manifest_records_the_writers_standing_and_reads_it_back(store):
    state = replica()
    standing = {"phase": "serving", "serving_rounds": 6}
    path = store.save(snapshot_at(state, 1), standing=standing)
    assert json.loads(path.read_text())["standing"] == standing
    assert read_manifest(path).standing == standing
    older = store.save(snapshot_at(state, 1))  # no standing: the field is left out, still loads
    assert "standing" not in json.loads(older.read_text())
    assert read_manifest(older).standing is None and store.newest_valid().step == 2


@pytest.mark.parametrize(
    "standing",
    [
        "serving",
        {"serving_rounds": 3},
        {"phase": 1, "serving_rounds": 3},
        {"phase": "serving", "serving_rounds": -1},
        {"phase": "serving", "serving_rounds": True},
        {"phase": "serving", "serving_rounds": 2.5},
    ],
)
def test_a_manifest_with_a_malformed_standing_is_skipped_as_invalid(store, standing):
    state = replica()
    store.save(snapshot_at(state, 1), standing={"phase": "serving", "serving_rounds": 1})
    path = store.save(snapshot_at(state, 1), standing={"phase": "serving", "serving_rounds": 2})
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "standing": standing}))
    with pytest.raises(CheckpointInvalid, match="field 'standing'"):
        read_manifest(path)
    with structlog.testing.capture_logs() as logs:
        assert [m.step for m in find_manifests(store.directory)] == [1]
    assert any(e["event"] == "checkpoint_skipped" and path.name in e["reason"] for e in logs)
    with pytest.raises(ValueError, match="standing"):
        store.save(snapshot_at(state, 1), standing=standing)


async def test_the_writer_records_the_standing_of_the_moment_it_queued_the_capture(store):
    state = replica()
    train(state, 2)
    standing = {"phase": "optimizer_sync", "serving_rounds": 0}

    def capture() -> concurrent.futures.Future:
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(state.capture())
        return done

    writer = CheckpointWriter(
        store,
        capture=capture,
        every_steps=2,
        metrics=NodeMetrics(role="worker"),
        standing=lambda: dict(standing),
    )
    writer.on_step(2)
    standing.update(phase="serving", serving_rounds=1)  # moves on before the write runs
    await wait_until_async(lambda: not writer.writing, what="the write to finish")
    assert find_manifests(store.directory)[0].standing == {"phase": "optimizer_sync", "serving_rounds": 0}
    train(state, 1, seed=1)
    await writer.close(step=3, timeout_s=10)  # the stop's own capture, with the standing then
    assert [(m.step, m.standing) for m in find_manifests(store.directory)] == [
        (3, {"phase": "serving", "serving_rounds": 1}),
        (2, {"phase": "optimizer_sync", "serving_rounds": 0}),
    ]
