"""A whole trained model in one file: every stage's weights, the run config, each stage's step.

    model.safetensors   tensors   stage<s>/<parameter name>, float32, one replica per stage
                        metadata  format, run_config (TOML), stage_steps (JSON list), source,
                                  tokenizer (JSON: the shard manifest's tokenizer entry, when
                                  the exporter was given the shards)
    model.toml          the same run config, next to it, for people and tools that read TOML

The weights come from one replica of each stage (its checkpoint, or its live state over RPC:
``tools/export_model.py``) or from the centralized reference; :meth:`ExportedModel.modules`
rebuilds the stage modules exactly as workers build them and loads the weights into them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import safetensors.numpy
import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from agora_core.config import RunConfig, parse_run_config
from agora_core.config.dump import dump_toml
from agora_core.errors import AgoraError, ConfigError
from agora_worker.model.build import build_stage
from agora_worker.state.snapshot import PARAM_PREFIX, StateSnapshot, TensorSpec

FORMAT = "agora-model-v1"
_KEY = re.compile(r"stage(\d+)/(.+)")


class ModelFileError(AgoraError):
    """A model file that is missing, not an Agora model, or does not fit its own run config."""


@dataclass(frozen=True)
class ExportedModel:
    run: RunConfig
    weights: list[dict[str, np.ndarray]]  # per stage: parameter name -> float32 array
    steps: list[int]  # per stage: the optimizer step its weights are at
    source: str  # where they came from: "checkpoints", "live", "reference"
    # The tokenizer of the shards it was trained on, as their manifest describes it (JSON text,
    # read by agora-trainer; "" when unknown), so evaluation refuses shards of another tokenizer.
    tokenizer: str = ""

    def __post_init__(self) -> None:
        n = self.run.model.n_stages
        if len(self.weights) != n or len(self.steps) != n:
            raise ModelFileError(
                f"the run has {n} stages; got weights for {len(self.weights)}, steps for {len(self.steps)}"
            )

    @property
    def parameters(self) -> int:
        return sum(int(a.size) for stage in self.weights for a in stage.values())

    def modules(self) -> list[nn.Module]:
        """Every stage's module with these weights, in eval mode (CPU)."""
        return [self._load(stage) for stage in range(self.run.model.n_stages)]

    def _load(self, stage: int) -> nn.Module:
        module = build_stage(self.run, stage)
        params = dict(module.named_parameters())
        weights = self.weights[stage]
        missing, extra = sorted(params.keys() - weights.keys()), sorted(weights.keys() - params.keys())
        if missing or extra:
            what = (
                f"lacks {missing[0]!r}" if missing else f"holds {extra[0]!r}, which the stage does not have"
            )
            raise ModelFileError(
                f"stage {stage}: the file {what} ({len(missing)} missing, {len(extra)} extra)"
            )
        with torch.no_grad():
            for name, param in params.items():
                array = weights[name]
                if tuple(array.shape) != tuple(param.shape):
                    raise ModelFileError(
                        f"stage {stage}: {name} has shape {tuple(array.shape)} in the file, "
                        f"{tuple(param.shape)} in the run config's model"
                    )
                param.copy_(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)))
        return module.eval()


def weights_from_snapshot(snapshot: StateSnapshot) -> dict[str, np.ndarray]:
    """A replica's weights from its state snapshot (optimizer state left out)."""
    return {
        name.removeprefix(PARAM_PREFIX): array
        for name, array in snapshot.tensors.items()
        if name.startswith(PARAM_PREFIX)
    }


def stage_param_specs(run: RunConfig, stage: int) -> dict[str, TensorSpec]:
    """What a replica's weights look like in its state (``param/<name>``, float32)."""
    return {
        f"{PARAM_PREFIX}{name}": TensorSpec(f"{PARAM_PREFIX}{name}", "float32", tuple(p.shape))
        for name, p in build_stage(run, stage).named_parameters()
    }


def weights_from_module(module: nn.Module) -> dict[str, np.ndarray]:
    return {
        name: p.detach().to("cpu", torch.float32, copy=True).numpy() for name, p in module.named_parameters()
    }


def write_model(path: str | Path, model: ExportedModel) -> Path:
    """Write ``model`` to ``path`` (safetensors, atomically) and its run config to ``path``
    with suffix ``.toml``; returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"stage{stage}/{name}": np.ascontiguousarray(array, dtype=np.float32)
        for stage, weights in enumerate(model.weights)
        for name, array in weights.items()
    }
    config = dump_toml(model.run)
    metadata = {
        "format": FORMAT,
        "run_config": config,
        "stage_steps": json.dumps(model.steps),
        "source": model.source,
    }
    if model.tokenizer:
        metadata["tokenizer"] = model.tokenizer
    for target, write in (
        (path, lambda tmp: safetensors.numpy.save_file(tensors, tmp, metadata=metadata)),
        (path.with_suffix(".toml"), lambda tmp: tmp.write_text(config)),
    ):
        partial = target.with_name(f".{target.name}.partial")
        try:
            write(partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return path


def read_model(path: str | Path) -> ExportedModel:
    """The model in ``path``; ModelFileError saying what is wrong with it otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ModelFileError(f"{path} does not exist (export one: python tools/export_model.py)")
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ModelFileError(
                    f"{path} is a safetensors file but not an Agora model "
                    f"(format {metadata.get('format')!r}, expected {FORMAT!r})"
                )
            arrays = {key: f.get_tensor(key) for key in f.keys()}
    except SafetensorError as exc:
        raise ModelFileError(f"{path} is not a readable safetensors file ({exc})") from None
    try:
        run = parse_run_config(metadata.get("run_config", ""))
    except ConfigError as exc:
        raise ModelFileError(f"{path}: its run config is invalid: {exc}") from None
    try:
        steps = json.loads(metadata.get("stage_steps", ""))
    except ValueError:
        steps = None
    n = run.model.n_stages
    if not isinstance(steps, list) or len(steps) != n or not all(isinstance(s, int) for s in steps):
        raise ModelFileError(f"{path}: stage_steps must list {n} step counts, got {steps!r}")
    weights: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    for key, array in arrays.items():
        match = _KEY.fullmatch(key)
        if match is None or int(match.group(1)) >= n:
            raise ModelFileError(f"{path}: tensor {key!r} is not stage<0..{n - 1}>/<parameter name>")
        weights[int(match.group(1))][match.group(2)] = array
    return ExportedModel(
        run=run,
        weights=weights,
        steps=steps,
        source=metadata.get("source", ""),
        tokenizer=metadata.get("tokenizer", ""),
    )
