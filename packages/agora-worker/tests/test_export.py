"""The exported-model file and running a whole model: bit-exact round trips, clear errors for
files that are not models, the swarm's staged computation equal to ComposedModel's, and
seeded sampling that repeats itself."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import safetensors.numpy
import torch

from agora_core.config import RunConfig, parse_run_config
from agora_core.config.run import ModelConfig
from agora_worker.model import ComposedModel, build_stage
from agora_worker.model.export import (
    ExportedModel,
    ModelFileError,
    read_model,
    weights_from_module,
    write_model,
)
from agora_worker.model.inference import WholeModel, generate, held_out_loss

MODEL = ModelConfig(
    d_model=32, n_heads=2, mlp_ratio=2.0, subspace_rank=4, vocab_size=256, seq_len=16, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="export", seed=11, model=MODEL)


def trained_weights(seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Each stage's initial weights moved by a random step: not what build_stage makes."""
    rng = np.random.default_rng(seed)
    out = []
    for stage in range(MODEL.n_stages):
        weights = weights_from_module(build_stage(RUN, stage))
        out.append(
            {n: (a + 0.05 * rng.standard_normal(a.shape)).astype(np.float32) for n, a in weights.items()}
        )
    return out


@pytest.fixture
def exported() -> ExportedModel:
    return ExportedModel(run=RUN, weights=trained_weights(), steps=[7, 7, 6], source="checkpoints")


def test_a_model_file_round_trips_bit_exact_with_its_config_and_steps(tmp_path, exported):
    path = write_model(tmp_path / "model.safetensors", exported)
    back = read_model(path)
    assert back.run == RUN and back.steps == [7, 7, 6] and back.source == "checkpoints"
    for mine, theirs in zip(exported.weights, back.weights, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(mine[n].tobytes() == theirs[n].tobytes() for n in mine)
    assert parse_run_config((tmp_path / "model.toml").read_text()) == RUN
    keys = safetensors.numpy.load_file(path).keys()
    assert "stage0/embedding" in keys and "stage2/lm_head.weight" in keys
    assert not list(tmp_path.glob(".*partial"))


def test_loaded_modules_hold_the_files_weights(tmp_path, exported):
    modules = read_model(write_model(tmp_path / "m.safetensors", exported)).modules()
    for module, weights in zip(modules, exported.weights, strict=True):
        assert all(p.detach().numpy().tobytes() == weights[n].tobytes() for n, p in module.named_parameters())


def test_files_that_are_not_agora_models_get_clear_errors(tmp_path, exported):
    with pytest.raises(ModelFileError, match="does not exist"):
        read_model(tmp_path / "nothing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 64)
    with pytest.raises(ModelFileError, match="not a readable safetensors file"):
        read_model(garbage)
    foreign = tmp_path / "foreign.safetensors"
    safetensors.numpy.save_file({"w": np.zeros(3, np.float32)}, foreign)
    with pytest.raises(ModelFileError, match="not an Agora model"):
        read_model(foreign)
    path = write_model(tmp_path / "good.safetensors", exported)
    tensors = safetensors.numpy.load_file(path)
    metadata = {"format": "agora-model-v1", "run_config": (tmp_path / "good.toml").read_text()}
    for broken, match in (
        ({**metadata, "stage_steps": json.dumps([1, 2])}, "stage_steps must list 3"),
        ({**metadata, "stage_steps": "[1, 1, 1]", "run_config": "[model]\nd_model = -1\n"}, "run config"),
    ):
        safetensors.numpy.save_file(tensors, tmp_path / "bad.safetensors", metadata=broken)
        with pytest.raises(ModelFileError, match=match):
            read_model(tmp_path / "bad.safetensors")
    safetensors.numpy.save_file(
        {**tensors, "stage9/x": np.zeros(1, np.float32)},
        tmp_path / "bad.safetensors",
        metadata={**metadata, "stage_steps": "[1, 1, 1]"},
    )
    with pytest.raises(ModelFileError, match=re.escape("'stage9/x' is not stage<0..2>")):
        read_model(tmp_path / "bad.safetensors")


def test_weights_that_do_not_fit_the_model_are_refused_by_name(exported):
    wrong = [dict(w) for w in exported.weights]
    wrong[1]["blocks.0.attn.qkv.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ModelFileError, match=r"stage 1: blocks.0.attn.qkv.weight has shape \(3, 3\)"):
        ExportedModel(run=RUN, weights=wrong, steps=[1, 1, 1], source="x").modules()
    wrong = [dict(w) for w in exported.weights]
    del wrong[2]["lm_head.weight"]
    with pytest.raises(ModelFileError, match=re.escape("stage 2: the file lacks 'lm_head.weight'")):
        ExportedModel(run=RUN, weights=wrong, steps=[1, 1, 1], source="x").modules()
    with pytest.raises(ModelFileError, match="the run has 3 stages"):
        ExportedModel(run=RUN, weights=wrong[:2], steps=[1, 1], source="x")


def held_out(n: int = 20, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, (n, MODEL.seq_len + 1), dtype=np.int64)


def test_the_staged_loss_equals_composed_models_on_the_same_weights(exported):
    samples = held_out()
    seen = []
    loss = held_out_loss(
        WholeModel(exported.modules(), seq_len=MODEL.seq_len),
        samples,
        batch_size=6,
        progress=lambda done, mean: seen.append(done),
    )
    composed = ComposedModel(exported.modules())
    with torch.no_grad():
        tokens = torch.from_numpy(samples)
        direct = float(composed(tokens[:, :-1], tokens[:, 1:]).double().mean())
    assert np.isfinite(loss) and loss == pytest.approx(direct, rel=1e-5)
    assert seen == [6, 12, 18, 20]
    untrained = held_out_loss(WholeModel([build_stage(RUN, s) for s in range(3)], seq_len=16), samples)
    assert untrained != pytest.approx(loss, rel=1e-3)  # the weights loaded are the ones scored


def test_sampling_repeats_with_a_seed_and_greedy_is_the_argmax(exported):
    model = WholeModel(exported.modules(), seq_len=MODEL.seq_len)
    prompt = np.array([100, 101, 102])
    first = generate(model, prompt, new_tokens=16, temperature=1.0, seed=3)
    assert (
        len(first) == 16
        and first.tolist() == generate(model, prompt, new_tokens=16, temperature=1.0, seed=3).tolist()
    )
    assert first.tolist() != generate(model, prompt, new_tokens=16, temperature=1.0, seed=4).tolist()
    greedy = generate(model, prompt, new_tokens=1)
    expected = int(model.logits(torch.tensor([prompt.tolist()]))[0, -1].argmax())
    assert greedy.tolist() == [expected]
    # the context slides: more tokens than seq_len still work
    assert len(generate(model, prompt, new_tokens=MODEL.seq_len + 2, temperature=0.5, vocab_limit=128)) > 0
    assert all(t < 128 for t in generate(model, prompt, new_tokens=10, temperature=2.0, vocab_limit=128))
    assert generate(model, prompt, new_tokens=5, stop_token=expected).tolist() == []
