"""Checkpoints of one replica's stage state: a safetensors file and a JSON manifest per step.

A checkpoint is two files in the worker's checkpoint directory:

    stage<s>-step<step>-<token>.safetensors   the StateSnapshot's tensors (no pickle)
    stage<s>-step<step>.json                  its manifest, written last

The manifest names the tensor file and holds what it takes to trust it: format version, run
name, a digest of the config parts that decide the tensors' shapes and meaning (the model
section and the seed), stage, step, the file's size, every tensor's SHA-256, the time it was
written, the run config itself as TOML and, optionally, the writer's standing when the
snapshot was captured: its sync phase and the averaging rounds it completed since it began
serving (``tools/export_model.py`` trusts a serving replica that has averaged). Both files
are written to a temporary name, fsynced and renamed, the manifest after the tensors: a crash
at any point leaves either the previous checkpoints or a complete new one, never a
valid-looking partial one. A tensor file with no manifest (a crash between the two) is
deleted by the next save.

Reading tries the newest first and skips, with a warning that names the file and why, any that
is truncated, unreadable, fails a digest, or belongs to another run, stage or model.
Manifests without a standing (written before workers recorded it) still load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import safetensors.numpy
from safetensors import SafetensorError, safe_open

from agora_core import world
from agora_core.config import RunConfig
from agora_core.config.dump import dump_toml
from agora_core.errors import AgoraError
from agora_core.observability.logs import get_logger
from agora_worker.state.snapshot import StateMismatch, StateSnapshot, tensor_digest

FORMAT = "agora-checkpoint-v1"
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists digests, not tensors: anything larger is not one
_MANIFEST_NAME = re.compile(r"stage(\d+)-step(\d+)\.json")

log = get_logger("worker.checkpoint")


class CheckpointInvalid(AgoraError):
    """A checkpoint that cannot be used; the message says which file and why."""


def _standing_problem(standing: Any) -> str | None:
    """What is wrong with a manifest's ``standing`` ({"phase": str, "serving_rounds": int >= 0}),
    None if nothing."""
    if not isinstance(standing, dict):
        return f"must be an object with phase and serving_rounds, not {type(standing).__name__}"
    phase, rounds = standing.get("phase"), standing.get("serving_rounds")
    if not isinstance(phase, str):
        return f"phase must be a string, got {phase!r}"
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        return f"serving_rounds must be an integer >= 0, got {rounds!r}"
    return None


def config_digest(run: RunConfig) -> str:
    """SHA-256 over what decides a checkpoint's tensor shapes and meaning: model section, seed."""
    parts = {"model": dataclasses.asdict(run.model), "seed": run.seed}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest as read from disk (its fields checked for type, not yet trusted)."""

    path: Path
    run: str
    config_digest: str
    stage: int
    step: int
    file: str
    file_bytes: int
    tensors: dict[str, str]  # name -> SHA-256 hex
    written: float  # unix time
    run_config: str  # the run config, TOML
    # The writer's sync phase at capture and its averaging rounds since it began serving;
    # None in manifests written before workers recorded it.
    standing: dict | None = None

    @property
    def tensor_path(self) -> Path:
        return self.path.parent / self.file


def read_manifest(path: Path) -> Manifest:
    """Parse one manifest; CheckpointInvalid naming the file if it is not a well-formed one."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointInvalid(f"{path}: unreadable: {path.stat().st_size} bytes is no manifest")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointInvalid(f"{path}: unreadable manifest ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointInvalid(f"{path}: unreadable: format {found!r}, expected {FORMAT!r}")
    kinds = {
        "run": str,
        "config_digest": str,
        "stage": int,
        "step": int,
        "file": str,
        "file_bytes": int,
        "tensors": dict,
        "written": (int, float),
        "run_config": str,
    }
    for name, kind in kinds.items():
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise CheckpointInvalid(f"{path}: unreadable: field {name!r} is missing or not {kind}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["tensors"].items()):
        raise CheckpointInvalid(f"{path}: unreadable: 'tensors' must map names to hex digests")
    if Path(data["file"]).name != data["file"]:
        raise CheckpointInvalid(f"{path}: unreadable: tensor file {data['file']!r} is not a plain file name")
    standing = data.get("standing")
    if standing is not None and (problem := _standing_problem(standing)) is not None:
        raise CheckpointInvalid(f"{path}: unreadable: field 'standing': {problem}")
    return Manifest(path=path, standing=standing, **{name: data[name] for name in kinds})


def find_manifests(directory: Path, *, warn: bool = True) -> list[Manifest]:
    """Every readable manifest in ``directory``, newest step first; unreadable ones are left
    out (and logged, with ``warn``)."""
    found = []
    for path in sorted(directory.glob("stage*-step*.json")):
        if not _MANIFEST_NAME.fullmatch(path.name):
            continue
        try:
            found.append(read_manifest(path))
        except CheckpointInvalid as exc:
            if warn:
                log.warning("checkpoint_skipped", file=str(path), reason=str(exc))
    return sorted(found, key=lambda m: (m.step, m.written), reverse=True)


def load_checkpoint(
    manifest: Manifest,
    *,
    run: RunConfig,
    stage: int,
    check: Callable[[StateSnapshot], None] | None = None,
    prefix: str = "",
) -> StateSnapshot:
    """The snapshot a manifest describes, after every check; CheckpointInvalid says why not.
    ``check`` (e.g. ``StageState.check``) may raise StateMismatch: another model shape.
    With ``prefix`` (e.g. ``param/``: the weights alone) only the tensors whose names start
    with it are read and their digests checked."""
    where = manifest.tensor_path
    if manifest.run != run.name:
        raise CheckpointInvalid(f"{manifest.path}: belongs to run {manifest.run!r}, not {run.name!r}")
    if manifest.stage != stage:
        raise CheckpointInvalid(f"{manifest.path}: a checkpoint of stage {manifest.stage}, not {stage}")
    if manifest.config_digest != config_digest(run):
        raise CheckpointInvalid(
            f"{manifest.path}: written for another model or seed (config digest "
            f"{manifest.config_digest[:12]}, this run's {config_digest(run)[:12]})"
        )
    try:
        size = where.stat().st_size
    except OSError as exc:
        raise CheckpointInvalid(f"{where}: unreadable ({exc})") from None
    if size != manifest.file_bytes:
        raise CheckpointInvalid(f"{where}: truncated: {size} bytes, the manifest says {manifest.file_bytes}")
    try:
        with safe_open(str(where), framework="np") as f:
            if set(f.keys()) != set(manifest.tensors):
                raise CheckpointInvalid(f"{where}: holds other tensors than its manifest lists")
            tensors = {name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}
    except (OSError, SafetensorError) as exc:
        raise CheckpointInvalid(f"{where}: unreadable ({exc})") from None
    for name, array in tensors.items():
        if tensor_digest(array) != manifest.tensors[name]:
            raise CheckpointInvalid(f"{where}: digest mismatch in tensor {name!r} (the file is corrupt)")
    snapshot = StateSnapshot(manifest.step, tensors, {n: manifest.tensors[n] for n in tensors})
    if check is not None:
        try:
            check(snapshot)
        except StateMismatch as exc:
            raise CheckpointInvalid(f"{where}: another model shape: {exc}") from None
    return snapshot


class CheckpointStore:
    """The checkpoints one worker keeps for its stage in ``directory`` (one directory per
    worker: two replicas of a stage writing the same step into one directory would collide)."""

    def __init__(self, directory: str | Path, *, run: RunConfig, stage: int, keep: int):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not 0 <= stage < run.model.n_stages:
            raise ValueError(f"stage {stage} does not exist: the run has stages 0..{run.model.n_stages - 1}")
        self.directory = Path(directory)
        self.run = run
        self.stage = stage
        self.keep = keep
        self.directory.mkdir(parents=True, exist_ok=True)

    def save(self, snapshot: StateSnapshot, *, standing: dict | None = None) -> Path:
        """Write ``snapshot`` atomically, then delete all but the newest ``keep``; returns the
        manifest's path. ``standing``: the writer's {"phase", "serving_rounds"} when the
        snapshot was captured, recorded in the manifest. Blocking file I/O and hashing: call it
        off the event loop."""
        if standing is not None and (problem := _standing_problem(standing)) is not None:
            raise ValueError(f"standing {problem}")
        started = world.monotonic()
        base = f"stage{self.stage}-step{snapshot.step:09d}"
        file_name = f"{base}-{world.token_hex(4)}.safetensors"
        tensor_path = self.directory / file_name
        partial = self.directory / f".{file_name}.partial"
        try:
            metadata = {"format": FORMAT, "run": self.run.name, "stage": str(self.stage)}
            safetensors.numpy.save_file(
                snapshot.tensors, partial, metadata={**metadata, "step": str(snapshot.step)}
            )
            _fsync(partial)
            os.replace(partial, tensor_path)
        finally:
            partial.unlink(missing_ok=True)
        manifest = {
            "format": FORMAT,
            "run": self.run.name,
            "config_digest": config_digest(self.run),
            "stage": self.stage,
            "step": snapshot.step,
            "file": file_name,
            "file_bytes": tensor_path.stat().st_size,
            "tensors": snapshot.digests(),
            "written": world.wall(),
            "run_config": dump_toml(self.run),
        }
        if standing is not None:
            manifest["standing"] = {"phase": standing["phase"], "serving_rounds": standing["serving_rounds"]}
        path = self.directory / f"{base}.json"
        _write_manifest(path, manifest)
        _fsync_directory(self.directory)
        removed = self.prune()
        log.info(
            "checkpoint_saved",
            stage=self.stage,
            step=snapshot.step,
            file=str(tensor_path),
            bytes=manifest["file_bytes"],
            standing=standing,
            seconds=round(world.monotonic() - started, 3),
            removed=removed,
        )
        return path

    def newest_valid(self, *, check: Callable[[StateSnapshot], None] | None = None) -> StateSnapshot | None:
        """The newest checkpoint that passes every check (None if there is none); each one
        skipped is logged with its file and reason."""
        for manifest in find_manifests(self.directory):
            try:
                return load_checkpoint(manifest, run=self.run, stage=self.stage, check=check)
            except CheckpointInvalid as exc:
                log.warning("checkpoint_skipped", file=str(manifest.path), reason=str(exc))
        return None

    def prune(self) -> int:
        """Delete this run's checkpoints of this stage beyond the newest ``keep``, and this
        stage's tensor or partial files no manifest names (left by a crash, or replaced);
        returns files removed. Another run's checkpoints are left alone (and never count)."""
        found = find_manifests(self.directory, warn=False)
        digest = config_digest(self.run)
        mine = [
            m for m in found if m.stage == self.stage and m.run == self.run.name and m.config_digest == digest
        ]
        removed = 0
        for manifest in mine[self.keep :]:
            manifest.path.unlink(missing_ok=True)
            removed += 1
        dropped = {m.path for m in mine[self.keep :]}
        kept = {m.file for m in found if m.path not in dropped}
        prefix = f"stage{self.stage}-step"
        for path in self.directory.iterdir():
            name = path.name.removeprefix(".")
            orphan = name.endswith(".safetensors") and name not in kept
            if name.startswith(prefix) and (orphan or name.endswith(".partial")):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    removed += 1
        return removed


def _write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    try:
        partial.write_text(json.dumps(manifest, indent=1) + "\n")
        _fsync(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    """Flush a file's bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path: Path) -> None:
    """Flush a directory's entries (the renames) to the disk, where the filesystem allows it."""
    with contextlib.suppress(OSError):
        _fsync(path)
