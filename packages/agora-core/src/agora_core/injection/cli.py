"""Failure injection through the DHT: order workers and trainers of a live run to fail.

    agora inject --run-dir runs/latest add --action exit --role worker --stage 1
    agora inject --bootstrap ADDR --config RUN.toml --key OP.key [--credential OP.cred] \\
        add --action exit --trigger averaging_send --stage 2 --fraction 0.5
    agora inject --run-dir runs/latest list
    agora inject --run-dir runs/latest clear [RECORD_ID ...]

``add`` writes one record, signed with the operator's key, under the run's injection key
(``<run>/operator/injections``); every worker and trainer reads that key about once a second
(``[operator] injection_watch_s``) and obeys a record only if an operator signed it: a key
listed in the run config's ``[operator] public_keys``, or in an authorized run the
authorizer's key or a key holding an ``operator`` credential (``agora-authorizer credential
--role operator``; pass it with ``--credential``, it travels in the record). A node obeys a
record at most once, and only while it lives (``--ttl``).

Targets (all given must hold): ``--node ID`` (repeatable; 8+ hex digits of a node id),
``--stage N``, ``--role worker|trainer``, ``--fraction F`` (each node decides by a hash of the
record id and its node id), or ``--all``. Nodes that start after the record was written obey
it only with ``--joiners`` (on by default for ``--trigger download``).

Triggers: ``now``, ``after`` (``--after S`` seconds after it was written), ``averaging_send``
(as the node streams averaging chunk ``--at-chunk`` of a slice, default 1: mid send),
``forward`` / ``backward`` (a worker: the request computed, its reply not sent; a trainer: at
its next hop), ``download`` (a joiner's state download, after ``--at-chunk`` pieces).

Actions: ``exit`` (os._exit, as a crash: no goodbye; ``--exit-code``, default 99), ``hang``
(the node blocks and answers nothing, ``--duration`` S or until killed), ``slow`` (compute x
``--factor`` for ``--duration`` S), ``drop_link`` (no RPC in or out for ``--duration`` S),
``nan`` (the next gradient it sends is NaN: the receiving worker's input check refuses it
and the trainer abandons that sample).

``python tools/inject.py`` is the same command. It is one more DHT member of the run: it needs
a bootstrap address and the run config,
nothing on the nodes' machines. ``--run-dir`` takes all of it from a local swarm's run
directory (swarm.json, run.toml, keys/operator.key, keys/operator.credential).
"""

from __future__ import annotations

import time

import click

from agora_core.injection import Action, InjectionRejected, Targets, Trigger
from agora_core.injection.publish import DEFAULT_TTL_S, clear, list_injections, new_injection, publish
from agora_core.node.operator_session import operator_options, resolve, run_or_exit
from agora_core.observability.logs import configure_logging


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@operator_options
@click.pass_context
def inject(ctx, run_dir, bootstrap, config, key_file, credential_file) -> None:
    """Order failures in a live Agora run through its DHT.

    `add` writes one record signed with the operator's key; every worker and trainer reads
    the run's records about once a second and obeys those an operator signed (a key in the
    run config's [operator] public_keys; in an authorized run also the authorizer's key or a
    key with an operator credential, given with --credential), each at most once, while the
    record lives. `list` shows the live records, `clear` deletes this operator's. --run-dir
    takes the bootstrap address, config and operator key of a local swarm (tools/swarm.py up).
    """
    configure_logging(fmt="console", level="warning")
    ctx.obj = lambda: resolve(run_dir, bootstrap, config, key_file, credential_file)


def _run(coroutine) -> None:
    run_or_exit(coroutine, InjectionRejected)


@inject.command()
@click.option(
    "--action", type=click.Choice([a.value for a in Action]), required=True, help="What the nodes do."
)
@click.option(
    "--trigger",
    type=click.Choice([t.value for t in Trigger]),
    help="When (default: now; --after implies after).",
)
@click.option("--after", "after_s", type=float, help="Seconds after the record is written (trigger after).")
@click.option(
    "--at-chunk", type=int, default=1, show_default=True, help="averaging_send/download: chunks first."
)
@click.option("--factor", type=float, default=1.0, help="slow: compute takes this many times as long.")
@click.option(
    "--duration",
    "duration_s",
    type=float,
    default=0.0,
    help="slow, drop_link, hang: seconds (hang 0: for good).",
)
@click.option(
    "--exit-code", type=int, default=99, show_default=True, help="exit: the code the process dies with."
)
@click.option("--node", "nodes", multiple=True, help="Target a node id (8+ hex digits; repeatable).")
@click.option("--stage", type=int, help="Target the workers of this stage.")
@click.option("--role", type=click.Choice(["worker", "trainer"]), help="Target one role.")
@click.option("--fraction", type=float, help="Target this fraction of the selected nodes (by hash).")
@click.option("--all", "everyone", is_flag=True, help="Target every node (when no other target is given).")
@click.option("--joiners/--no-joiners", default=None, help="Nodes starting after the record obey it too.")
@click.option(
    "--ttl", "ttl_s", type=float, default=DEFAULT_TTL_S, show_default=True, help="Seconds it lives once due."
)
@click.option("--id", "record_id", help="The record id (default: inj-<time>-<random>).")
@click.pass_obj
def add(
    operator,
    action,
    trigger,
    after_s,
    nodes,
    stage,
    role,
    fraction,
    everyone,
    joiners,
    ttl_s,
    record_id,
    **params,
):
    """Write one injection record; prints its id."""
    if not (nodes or stage is not None or role or fraction is not None or everyone):
        raise click.UsageError("name a target (--node, --stage, --role, --fraction) or say --all")
    trigger = trigger or ("after" if after_s is not None else "now")
    if joiners is None:
        joiners = trigger == Trigger.DOWNLOAD  # a download happens when a node joins
    targets = Targets(
        nodes=tuple(n.lower() for n in nodes), stage=stage, role=role, fraction=fraction, joiners=joiners
    )
    if after_s is not None:
        params["after_s"] = after_s

    async def go() -> None:
        found = operator()
        injection = new_injection(
            trigger=trigger,
            action=action,
            targets=targets,
            ttl_s=ttl_s,
            record_id=record_id,
            credential=found.credential_value(),
            **params,
        )
        node = await found.node()
        try:
            replicas = await publish(node.dht, found.key, found.run.name, injection)
        finally:
            await node.stop()
        click.echo(f"id {injection.id}")
        click.echo(
            f"  {injection.describe()}; on {replicas} replicas, expires in {injection.expires - time.time():.0f} s"
        )

    _run(go())


@inject.command("list")
@click.pass_obj
def list_command(operator) -> None:
    """The live injection records of the run (anyone's)."""

    async def go() -> None:
        found = operator()
        node = await found.node()
        try:
            listed = await list_injections(node.dht, found.run.name)
        finally:
            await node.stop()
        if not listed:
            click.echo("no injection records")
        for item in listed:
            writer = item.writer.hex()[:12] if item.writer else "unsigned"
            left = item.expiration - time.time()
            if item.injection is None:
                click.echo(f"{item.subkey[-40:]}  (unreadable: {item.problem}) by {writer}")
            else:
                click.echo(
                    f"{item.injection.id}  {item.injection.describe()}  by {writer}, {left:.0f} s left"
                )

    _run(go())


@inject.command("clear")
@click.argument("record_ids", nargs=-1)
@click.pass_obj
def clear_command(operator, record_ids) -> None:
    """Delete this operator's records (those named, or all). Nodes that armed one already may
    still obey it."""

    async def go() -> None:
        found = operator()
        node = await found.node()
        try:
            deleted = await clear(node.dht, found.key, found.run.name, list(record_ids) or None)
        finally:
            await node.stop()
        click.echo(f"cleared {len(deleted)} records" + (f": {', '.join(deleted)}" if deleted else ""))

    _run(go())
