#!/usr/bin/env python3
"""Assemble a run's trained model into one safetensors file, plus its run config as TOML.

    python tools/export_model.py --from-checkpoints DIR [--from-checkpoints DIR ...] [--config RUN.toml]
                                 [--shards DIR] [--out model.safetensors]
    python tools/export_model.py --bootstrap ADDRESS --config RUN.toml [--shards DIR] [--out model.safetensors]

From checkpoints: each DIR and every directory below it is searched (one per worker, or the
parent of them all); for each stage the newest valid checkpoint wins, and any that is
corrupt, truncated or of another run is skipped with the reason. Without --config the run
config is the one the newest checkpoint carries.

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
from pathlib import Path

import click

from agora_core.admission.credential import SignedCredential
from agora_core.admission.credential_file import load_credential
from agora_core.config import RunConfig, load_run_config, parse_run_config
from agora_core.contract import Phase
from agora_core.errors import AgoraError, ConfigError
from agora_core.identity import NodeKey
from agora_core.logs import configure_logging
from agora_core.metrics import NodeMetrics
from agora_core.run_node import RunNode
from agora_core.schema import (
    StageProgress,
    WorkerAnnouncement,
    parse_entries,
    stage_progress_key,
    stage_workers_key,
)
from agora_trainer.manifest import check_run_tokenizer, read_manifest, tokenizer_record
from agora_worker.checkpoint import CheckpointInvalid, Manifest, find_manifests, load_checkpoint
from agora_worker.joining import StateDownloadFailed, download_state
from agora_worker.model.export import (
    ExportedModel,
    ModelFileError,
    stage_param_specs,
    weights_from_snapshot,
    write_model,
)


class ExportFailed(AgoraError):
    """The model could not be assembled: a stage has no usable checkpoint or replica."""


# --- from checkpoints --------------------------------------------------------------------------------


def checkpoint_manifests(roots: list[Path]) -> list[Manifest]:
    """Every readable checkpoint manifest in ``roots`` and the directories below them."""
    directories: set[Path] = set()
    for root in roots:
        if not root.is_dir():
            raise ExportFailed(f"{root} is not a directory")
        directories.update(path.parent for path in root.rglob("stage*-step*.json"))
    return [m for directory in sorted(directories) for m in find_manifests(directory)]


def from_checkpoints(roots: list[Path], run: RunConfig | None) -> ExportedModel:
    manifests = checkpoint_manifests(roots)
    if not manifests:
        raise ExportFailed(f"no checkpoints in {', '.join(map(str, roots))}")
    if run is None:
        newest = max(manifests, key=lambda m: m.written)
        try:
            run = parse_run_config(newest.run_config)
        except ConfigError as exc:
            raise ExportFailed(f"{newest.path}: its run config is invalid ({exc}); pass --config") from None
        click.echo(f"run config from {newest.path}: run {run.name!r}")
    weights, steps = [], []
    for stage in range(run.model.n_stages):
        candidates = sorted(
            (m for m in manifests if m.stage == stage), key=lambda m: (m.step, m.written), reverse=True
        )
        for manifest in candidates:
            try:
                snapshot = load_checkpoint(manifest, run=run, stage=stage)
            except CheckpointInvalid as exc:
                click.echo(f"  skipped: {exc}")
                continue
            weights.append(weights_from_snapshot(snapshot))
            steps.append(snapshot.step)
            click.echo(
                f"stage {stage}: step {snapshot.step} from {manifest.path.parent} "
                f"({len(candidates)} checkpoints of this stage found)"
            )
            break
        else:
            raise ExportFailed(
                f"stage {stage} has no valid checkpoint of run {run.name!r} in these directories"
            )
    return ExportedModel(run=run, weights=weights, steps=steps, source="checkpoints")


# --- from live workers ---------------------------------------------------------------------------------


async def serving_replicas(node: RunNode, run: RunConfig, stage: int) -> list[tuple[WorkerAnnouncement, int]]:
    """The stage's serving replicas and their steps, most advanced first (none while the DHT
    does not answer)."""
    try:
        found = await node.dht.get(stage_workers_key(run.name, stage))
        reports = await node.dht.get(stage_progress_key(run.name, stage))
    except (AgoraError, TimeoutError):
        return []
    steps = {p.node_id: p.step for p in parse_entries(reports, StageProgress.from_value)}
    replicas = [
        (a, steps.get(a.node_id, 0))
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


if __name__ == "__main__":
    main()
