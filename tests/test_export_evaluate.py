"""The trained model comes out: `tools/export_model.py` assembles it from per-stage checkpoints
(skipping a corrupt one, and taking for each stage a checkpoint that agrees with the stage's
replicas, not merely the newest) or from live workers over RPC, and `tools/evaluate.py` scores it
on the shard set's validation split, exactly as a direct ComposedModel computation on the same
weights does, and samples text from it that repeats with its seed. The tools run as the user runs
them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from agora_core.config import RunConfig, parse_run_config
from agora_core.config.dump import dump_toml
from agora_core.config.run import DhtConfig, ModelConfig, OptimizerConfig
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_localswarm.results import HELD_OUT_ALARM_RATIO, export_and_evaluate, last_training_loss
from agora_model.export import (
    WINDOW_INTERVALS,
    checkpoint_manifests,
    choose_checkpoint,
    from_checkpoints,
    stage_candidates,
)
from agora_trainer.data.manifest import read_manifest, tokenizer_record
from agora_trainer.data.shards import open_shards
from agora_worker.model import ComposedModel, build_stage
from agora_worker.model.export import read_model
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.settings import WorkerSettings
from agora_worker.state.checkpoint import CheckpointStore, find_manifests
from agora_worker.state.snapshot import StageState, StateSnapshot
from agora_worker.worker import Worker

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
TOOL_S = 120  # one tool run: torch imports on a busy machine
CONFIG = """
name = "export-e2e"
seed = 21
[model]
d_model = 32
n_heads = 2
mlp_ratio = 2.0
subspace_rank = 4
vocab_size = 256
seq_len = 32
stage_layers = [1, 1, 1]
[optimizer]
lr = 3.0e-3
warmup_steps = 1
target_batch_size = 4
[checkpoint]
keep = 5
"""
RUN = parse_run_config(CONFIG)


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args], capture_output=True, text=True, timeout=TOOL_S
    )


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """A small shard set of real text, bytes (the run's tokenizer): one document to train on,
    one held out as the validation split."""
    out = tmp_path_factory.mktemp("shards")
    source = out / "source"
    source.mkdir()
    text = (ROOT / "packages" / "agora-worker" / "src" / "agora_worker" / "worker.py").read_text()
    (source / "a.txt").write_text(text[:6000])
    (source / "b.txt").write_text(text[6000:12000])
    made = tool(
        "make_shards.py",
        *(str(out / "data"), "--shards", "1", "--source", str(source), "--tokenizer", "bytes"),
        *("--validation-fraction", "0.5"),
    )
    assert made.returncode == 0, made.stderr
    return out / "data"


def train_checkpoints(shards: Path, root: Path) -> list[dict[int, StageState]]:
    """Three steps of every stage on the first shard, checkpointed after steps 2 and 3, each
    stage into its own directory (as one worker per stage would); the weights at each."""
    stages = [build_stage(RUN, s) for s in range(RUN.model.n_stages)]
    optimizers = [HostOptimizer(m, RUN.optimizer, clip_threshold=1.0) for m in stages]
    states = [StageState(m, o) for m, o in zip(stages, optimizers, strict=True)]
    stores = [CheckpointStore(root / f"worker-{s}-0", run=RUN, stage=s, keep=5) for s in range(len(stages))]
    shard = open_shards(shards)[0]
    saved: list[dict[int, dict]] = [{} for _ in stages]
    for step in range(1, 4):
        batch = np.stack([shard.sample(step * 4 + i, RUN.model.seq_len) for i in range(4)]).astype(np.int64)
        tokens, labels = torch.from_numpy(batch[:, :-1]), torch.from_numpy(batch[:, 1:])
        boundary = None
        for module in stages[:-1]:
            boundary = module(tokens, boundary)
        stages[-1](tokens, boundary, labels).sum().backward()
        for optimizer in optimizers:
            optimizer.accumulate(4)
            optimizer.apply()
        if step >= 2:
            for s, (state, store) in enumerate(zip(states, stores, strict=True)):
                snapshot = state.capture()
                store.save(snapshot)
                saved[s][step] = {n[6:]: a for n, a in snapshot.tensors.items() if n.startswith("param/")}
    return saved


def direct_loss(weights: list[dict[str, np.ndarray]], samples: np.ndarray) -> float:
    stages = [build_stage(RUN, s) for s in range(RUN.model.n_stages)]
    for module, stage_weights in zip(stages, weights, strict=True):
        module.load_state_dict({n: torch.from_numpy(a) for n, a in stage_weights.items()})
    with torch.no_grad():
        tokens = torch.from_numpy(samples.astype(np.int64))
        return float(ComposedModel(stages)(tokens[:, :-1], tokens[:, 1:]).double().mean())


@pytest.mark.timeout(5 * TOOL_S, func_only=True)
def test_export_from_checkpoints_then_evaluate_on_the_validation_split(tmp_path, shards):
    saved = train_checkpoints(shards, tmp_path / "checkpoints")
    newest_of_1 = find_manifests(tmp_path / "checkpoints" / "worker-1-0")[0].tensor_path
    newest_of_1.write_bytes(newest_of_1.read_bytes()[:-64])  # truncated: stage 1 falls back
    model = tmp_path / "model.safetensors"
    checkpoints = str(tmp_path / "checkpoints")
    export = tool(
        "export_model.py", "--from-checkpoints", checkpoints, "--out", str(model), "--shards", str(shards)
    )
    assert export.returncode == 0, export.stdout + export.stderr
    assert "stage 1: step 2" in export.stdout and "truncated" in export.stdout
    exported = read_model(model)
    assert exported.run == RUN and exported.steps == [3, 2, 3] and exported.source == "checkpoints"
    assert exported.tokenizer == tokenizer_record(read_manifest(shards).tokenizer)  # evaluate checks it
    chosen = [saved[0][3], saved[1][2], saved[2][3]]
    for mine, theirs in zip(chosen, exported.weights, strict=True):
        assert all(mine[n].tobytes() == theirs[n].tobytes() for n in mine)

    def evaluate(*extra: str) -> dict:
        args = [str(model), "--shards", str(shards), "--samples", "100000", "--tokens", "24", *extra]
        result = tool("evaluate.py", *args, "--json")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "held-out loss:" in result.stdout and "sample (temperature 0.9, seed 5):" in result.stdout
        return json.loads(result.stdout.strip().splitlines()[-1])

    first = evaluate("--temperature", "0.9", "--seed", "5")
    (held_out,) = open_shards(shards, "validation")
    everything = np.stack(
        [held_out.sample(i, RUN.model.seq_len) for i in range(held_out.sample_count(RUN.model.seq_len))]
    )
    assert first["held_out_shards"] == [held_out.name] and first["samples"] == len(everything)
    assert np.isfinite(first["held_out_loss"])
    assert first["held_out_loss"] == pytest.approx(direct_loss(chosen, everything), rel=1e-5)
    # bytes: bits per byte are nats per token over ln 2 (the held-out text has no separator)
    assert first["bits_per_byte"] == pytest.approx(first["held_out_loss"] / math.log(2), rel=1e-9)
    assert len(first["sample"]) > 0
    again = evaluate("--temperature", "0.9", "--seed", "5")
    assert again["sample"] == first["sample"] and again["held_out_loss"] == first["held_out_loss"]


def test_tools_report_bad_inputs_as_one_line_not_a_traceback(tmp_path, shards):
    missing = tool("evaluate.py", str(tmp_path / "none.safetensors"), "--shards", str(shards))
    assert (
        missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = tool(
        "export_model.py", "--from-checkpoints", str(empty), "--out", str(tmp_path / "m.safetensors")
    )
    assert nothing.returncode == 2 and "no checkpoints in" in nothing.stderr
    assert "Traceback" not in nothing.stderr


def serving(rounds: int) -> dict:
    return {"phase": "serving", "serving_rounds": rounds}


def trained_snapshot(stage: int) -> StateSnapshot:
    """A stage's state after one step on random gradients: weights and AdamW moments."""
    module = build_stage(RUN, stage)
    optimizer = HostOptimizer(module, RUN.optimizer, clip_threshold=1.0)
    generator = torch.Generator().manual_seed(stage)
    for p in optimizer.compute:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.accumulate(1)
    optimizer.apply()
    return StageState(module, optimizer).capture()


def write_replica(
    root: Path,
    worker: str,
    base: StateSnapshot,
    *,
    stage: int,
    step: int,
    standing: dict | None,
    scale: float = 1.0,
) -> dict[str, np.ndarray]:
    """A checkpoint of one replica of ``stage``: ``base``'s weights times ``scale`` (far from the
    others unless 1) plus noise of its own, as replicas that average differ a little; its weights."""
    rng = np.random.default_rng([stage, step, *worker.encode()])
    tensors = {
        name: (array * scale + 1e-3 * rng.standard_normal(array.shape)).astype(np.float32)
        if name.startswith("param/")
        else array
        for name, array in base.tensors.items()
    }
    store = CheckpointStore(root / worker, run=RUN, stage=stage, keep=2)
    store.save(StateSnapshot(step, tensors), standing=standing)
    return {n.removeprefix("param/"): a for n, a in tensors.items() if n.startswith("param/")}


def same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(a[n].tobytes() == b[n].tobytes() for n in a)


def test_export_takes_a_replica_that_agrees_not_a_wrecked_or_unserving_newest(tmp_path):
    root = tmp_path / "checkpoints"
    bases = [trained_snapshot(s) for s in range(RUN.model.n_stages)]
    head = [
        write_replica(root, f"worker-{w}", bases[0], stage=0, step=10 + w, standing=serving(4))
        for w in range(3)
    ]
    # stage 1: the newest was written by a worker still catching up, in optimizer_sync
    body = [
        write_replica(root, f"worker-{3 + w}", bases[1], stage=1, step=10 + w, standing=serving(3))
        for w in range(2)
    ]
    syncing = {"phase": "optimizer_sync", "serving_rounds": 0}
    write_replica(root, "worker-5", bases[1], stage=1, step=12, standing=syncing, scale=1.5)
    # the tail: the newest replica, serving, was wrecked by a bad step just before it stopped
    tail = [
        write_replica(root, f"worker-{6 + w}", bases[2], stage=2, step=10 + w, standing=serving(6))
        for w in range(2)
    ]
    write_replica(root, "worker-8", bases[2], stage=2, step=12, standing=serving(6), scale=8.0)
    model = tmp_path / "model.safetensors"
    export = tool("export_model.py", "--from-checkpoints", str(root), "--out", str(model))
    assert export.returncode == 0, export.stdout + export.stderr
    exported = read_model(model)
    assert exported.steps[1] == 11 and same(exported.weights[1], body[1])
    assert any(same(exported.weights[2], t) for t in tail) and exported.steps[2] in (10, 11)
    assert any(same(exported.weights[0], h) for h in head)
    lines = {line.split(":")[0]: line for line in export.stdout.splitlines() if line.startswith("stage ")}
    assert "closest to the median of 3 replicas" in lines["stage 0"]
    assert "the newer of 2 replicas" in lines["stage 1"] and "cannot be judged" in lines["stage 1"]
    assert "worker-5 step 12 skipped: written in optimizer_sync, not serving" in lines["stage 1"]
    assert "(serving 6 rounds; closest to the median of 3 replicas" in lines["stage 2"]
    assert "worker-8 step 12 is" in lines["stage 2"] and "WARNING" not in export.stdout


def test_a_stage_with_only_unserving_checkpoints_is_exported_with_a_warning(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    bases = [trained_snapshot(s) for s in range(RUN.model.n_stages)]
    for stage in (0, 2):
        write_replica(root, f"worker-{stage}", bases[stage], stage=stage, step=20, standing=serving(2))
    downloading = {"phase": "downloading", "serving_rounds": 0}
    write_replica(root, "worker-1a", bases[1], stage=1, step=19, standing=serving(0))
    newest = write_replica(root, "worker-1b", bases[1], stage=1, step=20, standing=downloading)
    model = from_checkpoints([root], RUN)
    assert model.steps == [20, 20, 20] and same(model.weights[1], newest)
    printed = capsys.readouterr().out
    [warning] = [line for line in printed.splitlines() if "WARNING" in line]
    assert warning.startswith("WARNING: stage 1: no trustworthy checkpoint; took step 20 from")
    assert "(written in downloading, not serving)" in warning
    assert "worker-1a step 19 skipped: written before its first averaging round while serving" in warning
    assert "stage 0: step 20" in printed and "the only replica in the vote" in printed


def test_the_vote_leaves_out_old_replicas_and_prefers_recorded_standings(tmp_path):
    root = tmp_path / "checkpoints"
    base = trained_snapshot(1)
    window = WINDOW_INTERVALS * RUN.checkpoint.every_steps
    write_replica(root, "worker-a", base, stage=1, step=10, standing=serving(2), scale=3.0)
    write_replica(root, "worker-b", base, stage=1, step=10 + window + 1, standing=serving(2))
    write_replica(root, "worker-c", base, stage=1, step=10 + window + 5, standing=None)
    candidates = stage_candidates(checkpoint_manifests([root]), RUN, 1)
    choice = choose_checkpoint(1, candidates, window_steps=window)
    assert choice.trusted and choice.taken.worker == "worker-b"
    assert "worker-a step 10 skipped: older than step" in choice.report
    assert "worker-c step" in choice.report and "skipped: no standing recorded" in choice.report
    # without any recorded standing, one without counts
    legacy = [c for c in candidates if c.worker == "worker-c"]
    assert choose_checkpoint(1, legacy, window_steps=window).trusted


@pytest.mark.timeout(3 * TOOL_S, func_only=True)
def test_the_run_end_warns_when_the_held_out_loss_is_far_above_the_last_training_losses(
    tmp_path, shards, capfd
):
    run_dir = tmp_path / "run"
    for stage in range(RUN.model.n_stages):  # near-initial weights: ~ln 256 nats a token held out
        write_replica(
            run_dir / "checkpoints",
            f"worker-{stage}",
            trained_snapshot(stage),
            stage=stage,
            step=5,
            standing=serving(1),
        )
    # the trainers' last 64 samples average 1.0; the earlier ones do not count
    (run_dir / "trainer-0.losses.jsonl").write_text(
        "".join(json.dumps({"id": i, "loss": 10.0, "t": i}) + "\n" for i in range(100)) + '{"id": 1, "lo'
    )
    (run_dir / "trainer-1.losses.jsonl").write_text(
        "".join(json.dumps({"id": i, "loss": 1.0, "t": 100 + i}) + "\n" for i in range(64))
    )
    assert last_training_loss(run_dir) == pytest.approx(1.0)
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(RUN))
    export_and_evaluate(run_dir, str(config), shards)
    printed = capfd.readouterr().out
    [held_out] = [line for line in printed.splitlines() if line.startswith("held-out loss:")]
    loss = float(held_out.split()[2])
    assert loss > HELD_OUT_ALARM_RATIO * 1.0
    [warning] = [line for line in printed.splitlines() if line.startswith("WARNING: the exported model")]
    assert f"{loss:.3f} nats/token" in warning and "last 64 samples, 1.000" in warning
    assert "--from-checkpoints" in warning and '"held_out_loss"' not in printed  # the JSON stays in


LIVE = RunConfig(
    name="export-live",
    seed=4,
    model=ModelConfig(
        d_model=32,
        n_heads=2,
        mlp_ratio=2.0,
        subspace_rank=4,
        vocab_size=256,
        seq_len=8,
        stage_layers=(1, 1, 1),
    ),
    optimizer=OptimizerConfig(target_batch_size=8),
    dht=DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0),
)


@pytest.mark.timeout(TOOL_S + 60, func_only=True)
async def test_export_from_live_workers_takes_one_replicas_weights_per_stage(tmp_path):
    config = tmp_path / "live.toml"
    config.write_text(dump_toml(LIVE))
    seed = DhtNode(key=NodeKey.generate(), config=LIVE.dht)
    workers: list[Worker] = []
    proc = None
    try:
        await seed.start()
        settings = WorkerSettings(device="cpu", progress_interval_s=0.1, announce_interval_s=0.2)
        expected = []
        for stage in range(LIVE.model.n_stages):
            worker = Worker(
                run=LIVE, stage=stage, key=NodeKey.generate(), bootstrap=[seed.address], settings=settings
            )
            workers.append(worker)
            await worker.start()
            # weights no other replica starts with, at a step of its own
            snapshot = worker.state.capture()
            rng = np.random.default_rng(stage)
            for name, array in snapshot.tensors.items():
                snapshot.tensors[name] = (array + rng.standard_normal(array.shape)).astype(np.float32)
            snapshot.step = 10 + stage
            await asyncio.wrap_future(worker.runtime.call(lambda w=worker, s=snapshot: w.state.install(s)))
            expected.append({n[6:]: a for n, a in snapshot.tensors.items() if n.startswith("param/")})
        model = tmp_path / "live.safetensors"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "tools" / "export_model.py"),
            *("--bootstrap", seed.address, "--config", str(config), "--out", str(model), "--timeout", "60"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=TOOL_S)
        assert proc.returncode == 0, output.decode()
        exported = read_model(model)
        assert exported.steps == [10, 11, 12] and exported.source == "live"
        for mine, theirs in zip(expected, exported.weights, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(mine[n].tobytes() == theirs[n].tobytes() for n in mine)
    finally:
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await asyncio.gather(*(w.stop(grace_s=1) for w in workers), return_exceptions=True)
        await seed.stop()
