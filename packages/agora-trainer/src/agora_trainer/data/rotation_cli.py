"""Shard rotation: say which shards each trainer of a live run reads, and change it as it runs.

    agora-trainer rotate-shards --run-dir runs/latest set --trainer trainer-0=0-3 --trainer trainer-1=4-7
    agora-trainer rotate-shards --bootstrap ADDR --config RUN.toml --key OP.key [--credential OP.cred] \\
        set --trainer 3f9c0a1e=0-31 --others 32-63 --shards shards/
    agora-trainer rotate-shards --run-dir runs/latest show
    agora-trainer rotate-shards --run-dir runs/latest clear

(``python tools/rotate_shards.py`` is the same command.)

``set`` writes one assignment, signed with the operator's key, under the run's
``<run>/operator/shards``: shard ranges (the manifest's shard ids, ``0-3,8``) per trainer (8+
hex digits of its node id, or in a local swarm its name), and with ``--others`` the ranges of
every trainer it does not name. Trainers read it every progress interval and obey the newest
one an operator signed (a key in the run config's ``[operator] public_keys``; in an authorized
run also the authorizer's key or a key with an operator credential). A trainer switches at
its current shard's end, never mid-shard; shards new to it open ``--handover`` seconds after
the record was written, so the trainer they come from has stopped opening them. No sample is
read twice or skipped within an epoch: a trainer never opens a shard another one holds or has
finished in that epoch. ``--shards DIR`` checks the ranges against that shard set's manifest.

An assignment is a standing order: a trainer keeps the last one it obeyed (across restarts)
after its record expires from the DHT (within the hour), until a newer one comes. ``show``
prints the assignments and what each trainer holds and has finished; ``clear`` writes a
newer record that names no trainer (all back to their own --shard-ranges) and deletes this
operator's older ones.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from agora_core.identity import NodeKey
from agora_core.node.operator_session import operator_options, resolve, run_or_exit
from agora_core.observability.logs import configure_logging
from agora_trainer.data.manifest import read_manifest
from agora_trainer.data.rotation import shard_claims_key
from agora_trainer.data.rotation_record import (
    DEFAULT_HANDOVER_S,
    RotationError,
    ShardAssignment,
    clear_assignments,
    format_ranges,
    longest_ttl_s,
    new_assignment,
    node_prefix,
    parse_ranges,
    publish_assignment,
    shard_assignment_key,
)

MAX_EPOCHS_SHOWN = 64  # show reads claims epoch by epoch up to the first empty one, at most this many


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@operator_options
@click.pass_context
def rotate_shards(ctx, run_dir, bootstrap, config, key_file, credential_file) -> None:
    """Assign shards to the trainers of a live Agora run through its DHT.

    `set` writes an assignment signed with the operator's key; trainers switch to it at
    their next shard boundary. `show` prints the assignments and the trainers' shards,
    `clear` deletes this operator's assignments. --run-dir takes the bootstrap address,
    config and operator key of a local swarm (tools/swarm.py up).
    """
    configure_logging(fmt="console", level="warning")
    ctx.obj = lambda: resolve(run_dir, bootstrap, config, key_file, credential_file)
    ctx.meta["run_dir"] = run_dir


def _trainer_id(name: str, run_dir: str | None) -> str:
    """A node id prefix as given, or a local swarm trainer's (``trainer-0``) from its key."""
    if run_dir is not None and not all(c in "0123456789abcdefABCDEF" for c in name):
        key_file = Path(run_dir) / "keys" / f"{name}.key"
        if not key_file.exists():
            raise click.UsageError(f"--trainer {name}: no key {key_file} in the run directory")
        return NodeKey.load(key_file).node_id
    return name


def _check_against(shards: str, ranges: list[frozenset[int]]) -> None:
    ids = {entry.id for entry in read_manifest(shards).split("train")}
    for wanted in ranges:
        unknown = sorted(wanted - ids)
        if unknown:
            raise click.UsageError(f"{shards} has no training shards {format_ranges(unknown)}")
    unread = ids - set().union(*ranges)
    if unread:
        click.echo(f"note: no trainer named here reads shards {format_ranges(unread)}", err=True)


def _ttl(operator) -> float:
    """As long as the run's DHT keeps a record (trainers keep obeying it after that anyway)."""
    return longest_ttl_s(operator.run.dht.max_expiration_ahead_s, operator.run.dht.max_clock_skew_s)


def _run(coroutine) -> None:
    run_or_exit(coroutine, RotationError)


@rotate_shards.command("set")
@click.option(
    "--trainer",
    "trainers",
    multiple=True,
    help="ID=RANGES: a trainer (node id prefix or name) and its shards.",
)
@click.option("--others", help="RANGES for every trainer not named (default: their own --shard-ranges).")
@click.option(
    "--handover",
    "handover_s",
    type=float,
    default=DEFAULT_HANDOVER_S,
    show_default=True,
    help="Seconds before a shard new to a trainer opens there.",
)
@click.option(
    "--shards", type=click.Path(file_okay=False, exists=True), help="Check the ranges against this shard set."
)
@click.pass_context
def set_command(ctx, trainers, others, handover_s, shards) -> None:
    """Write an assignment: trainers switch to it at their next shard boundary."""
    if not trainers and others is None:
        raise click.UsageError("name a trainer (--trainer ID=RANGES) or give --others RANGES")
    try:
        given = {}
        for item in trainers:
            name, sep, ranges = item.partition("=")
            if not sep:
                raise click.UsageError(f"--trainer {item}: expected ID=RANGES, e.g. trainer-0=0-3,8")
            given[node_prefix(_trainer_id(name.strip(), ctx.meta["run_dir"]))] = parse_ranges(ranges)
        rest = None if others is None else parse_ranges(others)
    except RotationError as exc:
        raise click.UsageError(str(exc)) from None
    if shards is not None:
        _check_against(shards, [*given.values(), *([rest] if rest is not None else [])])

    async def go() -> None:
        found = ctx.obj()
        record = new_assignment(
            given, others=rest, handover_s=handover_s, ttl_s=_ttl(found), credential=found.credential_value()
        )
        node = await found.node()
        try:
            replicas = await publish_assignment(node.dht, found.key, found.run.name, record)
        finally:
            await node.stop()
        click.echo(f"id {record.id}")
        click.echo(f"  {record.describe()}; on {replicas} replicas, handover {record.handover_s:g} s")

    _run(go())


@rotate_shards.command("show")
@click.pass_obj
def show_command(operator) -> None:
    """The assignments (newest first: the one in force) and every trainer's shards."""

    async def go() -> None:
        found = operator()
        node = await found.node()
        try:
            records = await node.dht.get(shard_assignment_key(found.run.name))
            epochs = []
            for epoch in range(MAX_EPOCHS_SHOWN):
                claims = await node.dht.get(shard_claims_key(found.run.name, epoch))
                if not claims:
                    break
                epochs.append((epoch, claims))
        finally:
            await node.stop()
        listed = []
        for subkey, value in records.items():
            try:
                listed.append((ShardAssignment.from_value(value.value), value.writer))
            except RotationError as exc:
                click.echo(f"{subkey[-40:]}  (unreadable: {exc})")
        listed.sort(key=lambda item: -item[0].issued)
        if not listed:
            click.echo("no shard assignments: every trainer reads its own --shard-ranges")
        for n, (record, writer) in enumerate(listed):
            age = time.time() - record.issued
            state = "in force" if n == 0 else "replaced"
            by = writer.hex()[:12] if writer else "unsigned"
            click.echo(f"{record.id}  {record.describe()}  by {by}, {age:.0f} s ago ({state})")
        for epoch, claims in epochs:
            for value in claims.values():
                claim = value.value if isinstance(value.value, dict) else {}
                reading = [
                    f"{p.get('shard')} ({p.get('watermark')} done)"
                    for p in claim.get("open", [])
                    if isinstance(p, dict)
                ]
                click.echo(
                    f"epoch {epoch}  trainer {str(claim.get('node_id'))[:12]}: reading {', '.join(reading) or '-'}; "
                    f"finished {format_ranges(claim.get('finished', [])) or '-'}; "
                    f"{time.time() - float(claim.get('t', 0)):.0f} s ago"
                )

    _run(go())


@rotate_shards.command("clear")
@click.pass_obj
def clear_command(operator) -> None:
    """Delete this operator's assignments; trainers go back to their own --shard-ranges."""

    async def go() -> None:
        found = operator()
        node = await found.node()
        try:
            reset, deleted = await clear_assignments(
                node.dht, found.key, found.run.name, ttl_s=_ttl(found), credential=found.credential_value()
            )
        finally:
            await node.stop()
        click.echo(f"id {reset.id}: every trainer back to its own --shard-ranges from its next shard")
        click.echo(
            f"  deleted {len(deleted)} older assignments" + (f": {', '.join(deleted)}" if deleted else "")
        )

    _run(go())
