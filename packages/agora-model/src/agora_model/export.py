"""Assemble a run's trained model into one safetensors file, plus its run config as TOML.

    python tools/export_model.py --from-checkpoints DIR [--from-checkpoints DIR ...] [--config RUN.toml]
                                 [--shards DIR] [--out model.safetensors]
    python tools/export_model.py --bootstrap ADDRESS --config RUN.toml [--shards DIR] [--out model.safetensors]

(``agora-model export`` is the same command.)

From checkpoints: each DIR and every directory below it is searched (one per worker, or the
parent of them all). Each worker directory offers its newest valid checkpoint of a stage (any
that is corrupt, truncated or of another run is skipped with the reason), and for each stage
the one that agrees with its replicas is taken (``choose_checkpoint``: written while serving
after an averaging round, and closest to the median of the replicas' weights), not merely the
newest: a replica wrecked by a bad step just before it stopped may hold the newest step. One
line per stage says which and why; a stage with no trustworthy checkpoint takes its newest with
a WARNING. Without --config the run config is the one the newest checkpoint carries.

From live workers: joins the run's DHT through ADDRESS as a light member, reads each stage's
worker announcements, and downloads the weights of one serving replica per stage (the most
advanced first, another if it fails) over ``state.manifest`` / ``state.fetch``.

The file holds ``stage<s>/<parameter name>`` tensors and, as metadata, the run config, each
stage's step and, with --shards, the tokenizer of the run's shards (checked against the run
config first); ``tools/evaluate.py`` loads it and refuses shards of another tokenizer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from agora_core.admission.credential import SignedCredential
from agora_core.admission.credential_file import load_credential
from agora_core.config import RunConfig, load_run_config, parse_run_config
from agora_core.contract import Phase
from agora_core.errors import AgoraError, ConfigError
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.logs import configure_logging
from agora_core.observability.metrics import NodeMetrics
from agora_core.schema import (
    StageProgress,
    WorkerAnnouncement,
    parse_entries,
    stage_progress_key,
    stage_workers_key,
)
from agora_trainer.data.manifest import check_run_tokenizer, read_manifest, tokenizer_record
from agora_worker.joining import StateDownloadFailed, download_state
from agora_worker.model.export import (
    ExportedModel,
    ModelFileError,
    stage_param_specs,
    weights_from_snapshot,
    write_model,
)
from agora_worker.progress.decision import heard_steps
from agora_worker.state.checkpoint import CheckpointInvalid, Manifest, find_manifests, load_checkpoint
from agora_worker.state.snapshot import PARAM_PREFIX, StateMismatch, StateSnapshot, TensorSpec


class ExportFailed(AgoraError):
    """The model could not be assembled: a stage has no usable checkpoint or replica."""


# --- from checkpoints --------------------------------------------------------------------------------

# A stage's vote takes the replicas whose checkpoints lie within this many checkpoint intervals
# of the newest trusted one. Replicas still up at the end write their last checkpoints within
# about an interval of each other (one whose last write failed left the one before); a replica
# that left the run long before holds older weights, which belong to another point of training.
WINDOW_INTERVALS = 2


@dataclass(frozen=True, eq=False)  # hashed by identity: a key of choose_checkpoint's notes
class Candidate:
    """One worker directory's newest valid checkpoint of a stage, with its weights."""

    manifest: Manifest
    weights: dict[str, np.ndarray]  # parameter name -> float32 array
    finite: bool  # every weight is a finite number

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def worker(self) -> str:
        return self.manifest.path.parent.name

    def newness(self) -> tuple[int, float]:
        return self.manifest.step, self.manifest.written

    def distrust(self) -> str | None:
        """Why this checkpoint cannot be trusted to agree with its stage's replicas (None: it
        can). A manifest without a standing is not distrusted (see choose_checkpoint)."""
        if not self.finite:
            return "its weights are not all finite"
        standing = self.manifest.standing
        if standing is None:
            return None
        if standing["phase"] != Phase.SERVING:
            return f"written in {standing['phase']}, not serving"
        if standing["serving_rounds"] < 1:
            return "written before its first averaging round while serving"
        return None

    def describe(self) -> str:
        standing = self.manifest.standing
        if standing is None:
            return "no standing recorded"
        if standing["phase"] != Phase.SERVING:
            return standing["phase"]
        rounds = standing["serving_rounds"]
        return f"serving {rounds} round{'' if rounds == 1 else 's'}"


@dataclass(frozen=True)
class Choice:
    taken: Candidate
    trusted: bool  # False: no candidate qualified, ``taken`` is merely the newest
    report: str  # one line: what was taken, and why


def checkpoint_manifests(roots: list[Path]) -> dict[Path, list[Manifest]]:
    """Every readable checkpoint manifest in ``roots`` and the directories below them, by
    directory (one per worker), newest first."""
    directories: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            raise ExportFailed(f"{root} is not a directory")
        directories.update(path.parent for path in root.rglob("stage*-step*.json"))
    return {directory: find_manifests(directory) for directory in sorted(directories)}


def stage_candidates(found: dict[Path, list[Manifest]], run: RunConfig, stage: int) -> list[Candidate]:
    """Each directory's newest valid checkpoint of ``stage``, its weights only; each one
    skipped on the way is printed with why."""
    check = _weights_check(stage_param_specs(run, stage))
    candidates = []
    for manifests in found.values():
        for manifest in (m for m in manifests if m.stage == stage):
            try:
                snapshot = load_checkpoint(manifest, run=run, stage=stage, check=check, prefix=PARAM_PREFIX)
            except CheckpointInvalid as exc:
                click.echo(f"  skipped: {exc}")
                continue
            weights = weights_from_snapshot(snapshot)
            finite = all(np.isfinite(a).all() for a in weights.values())
            candidates.append(Candidate(manifest=manifest, weights=weights, finite=finite))
            break
    return candidates


def choose_checkpoint(stage: int, candidates: list[Candidate], *, window_steps: int) -> Choice:
    """The checkpoint of ``stage`` to export, of one directory's newest each (``candidates``).

    Qualified: finite weights, written while serving after at least one averaging round. A
    manifest without a standing (written before workers recorded it) qualifies too, but only
    when none with a qualifying standing exists. Of the qualified, the vote takes those within
    ``window_steps`` of the newest and picks the one closest to the coordinate-wise median of
    their weights: a replica wrecked by a bad step stands far from the others however new it
    is. With one or two in the vote the newest is taken (two cannot tell which one strayed).
    With none qualified the newest valid one is taken, with a warning saying why it is not
    trusted."""
    if not candidates:
        raise ValueError(f"stage {stage}: no candidates to choose from")
    notes = {c: f"skipped: {c.distrust()}" for c in candidates if c.distrust() is not None}
    recorded = [c for c in candidates if c.distrust() is None and c.manifest.standing is not None]
    unrecorded = [c for c in candidates if c.distrust() is None and c.manifest.standing is None]
    pool = recorded or unrecorded
    notes.update((c, "skipped: no standing recorded") for c in unrecorded if recorded)
    if not pool:
        taken = max(candidates, key=lambda c: (c.finite, c.newness()))
        return Choice(
            taken=taken,
            trusted=False,
            report=f"WARNING: stage {stage}: no trustworthy checkpoint; took step {taken.step} from "
            f"{taken.manifest.path.parent} anyway ({taken.distrust()}): its weights may not agree with "
            f"the stage's replicas{_others(candidates, taken, notes)}",
        )
    oldest = max(c.step for c in pool) - window_steps
    voters = sorted((c for c in pool if c.step >= oldest), key=Candidate.newness, reverse=True)
    notes.update((c, f"skipped: older than step {oldest}, out of the vote") for c in pool if c.step < oldest)
    taken = voters[0]
    if len(voters) >= 3:
        offsets = median_offsets([c.weights for c in voters])
        best = min(range(len(voters)), key=offsets.__getitem__)  # a tie goes to the newer
        taken = voters[best]
        why = f"closest to the median of {len(voters)} replicas, {_percent(offsets[best])} off"
        notes.update((c, f"is {_percent(off)} off") for c, off in zip(voters, offsets, strict=True))
    elif len(voters) == 2:
        # The median of two is their mean, half the gap from each.
        apart = 2 * median_offsets([c.weights for c in voters])[0]
        why = f"the newer of 2 replicas, {_percent(apart)} apart: agreement cannot be judged with two"
    else:
        why = "the only replica in the vote"
    report = (
        f"stage {stage}: step {taken.step} from {taken.manifest.path.parent} ({taken.describe()}; "
        f"{why}{_others(candidates, taken, notes)})"
    )
    return Choice(taken=taken, trusted=True, report=report)


def median_offsets(weights: list[dict[str, np.ndarray]]) -> list[float]:
    """Each replica's distance to the coordinate-wise median of them all, relative to the
    median's norm, over all its parameters as one vector."""
    squared = np.zeros(len(weights))
    norm_squared = 0.0
    for name in weights[0]:
        stacked = np.stack([w[name] for w in weights]).astype(np.float64)  # (replicas, *shape)
        median = np.median(stacked, axis=0)
        squared += ((stacked - median) ** 2).reshape(len(weights), -1).sum(axis=1)
        norm_squared += float((median**2).sum())
    return [float(d) for d in np.sqrt(squared) / max(np.sqrt(norm_squared), 1e-30)]


def from_checkpoints(roots: list[Path], run: RunConfig | None) -> ExportedModel:
    """Each stage's most trustworthy checkpoint (``choose_checkpoint``), one line per stage."""
    found = checkpoint_manifests(roots)
    manifests = [m for listed in found.values() for m in listed]
    if not manifests:
        raise ExportFailed(f"no checkpoints in {', '.join(map(str, roots))}")
    if run is None:
        newest = max(manifests, key=lambda m: m.written)
        try:
            run = parse_run_config(newest.run_config)
        except ConfigError as exc:
            raise ExportFailed(f"{newest.path}: its run config is invalid ({exc}); pass --config") from None
        click.echo(f"run config from {newest.path}: run {run.name!r}")
    window_steps = WINDOW_INTERVALS * run.checkpoint.every_steps
    weights, steps = [], []
    for stage in range(run.model.n_stages):
        candidates = stage_candidates(found, run, stage)
        if not candidates:
            raise ExportFailed(
                f"stage {stage} has no valid checkpoint of run {run.name!r} in these directories"
            )
        choice = choose_checkpoint(stage, candidates, window_steps=window_steps)
        click.echo(choice.report)
        weights.append(choice.taken.weights)
        steps.append(choice.taken.step)
    return ExportedModel(run=run, weights=weights, steps=steps, source="checkpoints")


def _weights_check(expected: dict[str, TensorSpec]) -> Callable[[StateSnapshot], None]:
    """A check that a snapshot's weights are the stage's, each of its shape (the vote stacks them)."""

    def check(snapshot: StateSnapshot) -> None:
        if snapshot.tensors.keys() != expected.keys():
            raise StateMismatch(
                f"its weights are not this stage's ({len(snapshot.tensors)} of {len(expected)})"
            )
        for name, array in snapshot.tensors.items():
            if tuple(array.shape) != expected[name].shape:
                raise StateMismatch(f"{name}: shape {tuple(array.shape)}, the stage's {expected[name].shape}")

    return check


def _others(candidates: list[Candidate], taken: Candidate, notes: dict[Candidate, str]) -> str:
    others = [f"{c.worker} step {c.step} {notes[c]}" for c in candidates if c is not taken and c in notes]
    return "".join(f"; {note}" for note in others)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.2f} %"


# --- from live workers ---------------------------------------------------------------------------------


async def serving_replicas(node: RunNode, run: RunConfig, stage: int) -> list[tuple[WorkerAnnouncement, int]]:
    """The stage's serving replicas and their steps, most advanced first (none while the DHT
    does not answer)."""
    try:
        found = await node.dht.get(stage_workers_key(run.name, stage))
        reports = await node.dht.get(stage_progress_key(run.name, stage))
    except (AgoraError, TimeoutError):
        return []
    # a minority claiming far steps is not the most advanced replica
    steps = heard_steps({p.node_id: p.step for p in parse_entries(reports, StageProgress.from_value)})
    replicas = [
        (a, steps.get(a.node_id, -1))
        for a in parse_entries(found, WorkerAnnouncement.from_value)
        if a.phase is Phase.SERVING and a.address
    ]
    return sorted(replicas, key=lambda r: -r[1])


async def from_live(
    run: RunConfig,
    bootstrap: str,
    *,
    timeout_s: float,
    key: NodeKey | None = None,
    credential: SignedCredential | None = None,
) -> ExportedModel:
    """Export from the serving workers of a live run; in an authorized run as ``key``, with
    an operator ``credential`` (agora-authorizer credential --role operator)."""
    node = RunNode(
        run=run,
        key=key or NodeKey.generate(),
        metrics=NodeMetrics(role="export"),
        bootstrap=[bootstrap],
        credential=credential,
    )
    await node.start()
    one_replica = dataclasses.replace(run.join, max_donors=1)  # every tensor of a stage from one replica
    try:
        async with asyncio.timeout(timeout_s):
            weights, steps = [], []
            for stage in range(run.model.n_stages):
                replicas = await serving_replicas(node, run, stage)
                while not replicas:  # a member that just joined may not see every record yet
                    await asyncio.sleep(1.0)
                    replicas = await serving_replicas(node, run, stage)
                expected = stage_param_specs(run, stage)
                for announcement, _step in replicas:
                    try:
                        snapshot, download = await download_state(
                            node.client, [announcement.address], expected=expected, config=one_replica
                        )
                    except (StateDownloadFailed, AgoraError) as exc:
                        click.echo(f"  stage {stage}: {announcement.address} failed ({exc}); trying another")
                        continue
                    weights.append(weights_from_snapshot(snapshot))
                    steps.append(snapshot.step)
                    click.echo(
                        f"stage {stage}: step {snapshot.step} from {announcement.node_id[:12]} at "
                        f"{announcement.address} ({download.total_bytes / 1e6:.1f} MB)"
                    )
                    break
                else:
                    raise ExportFailed(f"no serving replica of stage {stage} delivered its weights")
    except TimeoutError:
        raise ExportFailed(f"the export did not finish within {timeout_s:g} s (--timeout)") from None
    finally:
        await node.stop()
    return ExportedModel(run=run, weights=weights, steps=steps, source="live")


# --- command ---------------------------------------------------------------------------------------------


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--from-checkpoints",
    "checkpoint_dirs",
    multiple=True,
    type=click.Path(path_type=Path),
    help="Checkpoint directory, or a parent of several (repeatable).",
)
@click.option("--bootstrap", help="Address of a DHT member of a live run: export from its workers.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="Run config TOML.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("model.safetensors"),
    show_default=True,
    help="Model file to write (its run config goes next to it as .toml).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=300.0,
    show_default=True,
    help="Live export: give up after this.",
)
@click.option(
    "--shards",
    "shards_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="The run's shard set: its tokenizer is checked against the run and recorded in the file.",
)
@click.option(
    "--key-file", type=click.Path(dir_okay=False), help="Live export, authorized run: this tool's key."
)
@click.option(
    "--credential",
    "credential_file",
    type=click.Path(dir_okay=False),
    help="Live export, authorized run: the key's operator credential (agora-authorizer credential).",
)
def main(
    checkpoint_dirs, bootstrap, config_file, out, timeout_s, shards_dir, key_file, credential_file
) -> None:
    """Assemble a run's trained model (one replica per stage) into one safetensors file."""
    configure_logging(fmt="console", level="warning")
    if bool(checkpoint_dirs) == bool(bootstrap):
        raise click.UsageError("give either --from-checkpoints DIR (repeatable) or --bootstrap ADDRESS")
    started = time.monotonic()
    try:
        run = load_run_config(config_file) if config_file else None
        if checkpoint_dirs:
            model = from_checkpoints(list(checkpoint_dirs), run)
        else:
            if run is None:
                raise click.UsageError("a live export needs --config (the run's DHT settings and name)")
            key, credential = None, None
            if run.admission.authorized:
                if not (key_file and credential_file):
                    raise click.UsageError(
                        "a live export from an authorized run needs --key-file and --credential"
                    )
                key = NodeKey.load(key_file)
                credential = load_credential(
                    credential_file,
                    authorizer_public_key=run.admission.authorizer_key_bytes,
                    run=run.name,
                    public_key=key.public_key,
                )
            model = asyncio.run(
                from_live(run, bootstrap, timeout_s=timeout_s, key=key, credential=credential)
            )
        model.modules()  # every stage loads into the run's model: the file is usable
        if shards_dir is not None:  # the tokenizer travels with the model: evaluation checks it
            entry = read_manifest(shards_dir).tokenizer
            check_run_tokenizer(entry, model.run.data, model.run.model.vocab_size, where=str(shards_dir))
            model = dataclasses.replace(model, tokenizer=tokenizer_record(entry))
        write_model(out, model)
    except (ExportFailed, ModelFileError, AgoraError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    size_mb = out.stat().st_size / 1e6
    click.echo(
        f"wrote {out} ({model.parameters / 1e6:.2f} M parameters, {size_mb:.1f} MB, "
        f"steps {model.steps}) and {out.with_suffix('.toml')} in {time.monotonic() - started:.1f} s"
    )
