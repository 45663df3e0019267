"""``agora-authorizer``: admit nodes to a run, and the operator's commands around it.

    agora-authorizer keygen --key-file K          # the key whose public half the run config names
    agora-authorizer account add NAME --db DB     # prints the account's token
    agora-authorizer serve --config RUN.toml --key-file K [--db DB] [--listen HOST:PORT]
    agora-authorizer status --db DB               # queue, admitted per stage, refusals by reason
    agora-authorizer ban NODE_ID|ACCOUNT --db DB  # refused at its next refresh, and in the DHT
    agora-authorizer pin NODE_ID STAGE --db DB    # place that node on STAGE when it joins
    agora-authorizer accusations --db DB          # what nodes accused each other of, and what counts
    agora-authorizer pardon NODE_ID --db DB       # lift its ban; accusations made so far count no more
    agora-authorizer credential --config RUN.toml --node-key F --role dht --out C  # a seed's

The database is SQLite by default, a file next to the key (``authorizer.db``); give
``--db postgresql://user@host/dbname`` for PostgreSQL. Every command but ``serve`` works on
the database alone, with the service running or not.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import signal
import sys
import time
from pathlib import Path

import click

from agora_authorizer import __version__, cli_credential
from agora_authorizer.accusations_report import accusations_report, format_accusations
from agora_authorizer.status import format_status, status_report
from agora_authorizer.store import AlreadyExists, Store, StoreError
from agora_core.admission.software import local_build
from agora_core.config import NodeSettings
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.heap import settle_startup_heap
from agora_core.node.options import fail, load_config, resolve_node
from agora_core.observability.logs import configure_logging
from agora_core.observability.metrics_exposure import MetricsExposure

DEFAULT_KEY = "~/.agora/authorizer.key"
NODE_ID = re.compile(r"^[0-9a-f]{40}$")


def _key_file_option(command):
    return click.option(
        "--key-file",
        envvar="AGORA_AUTHORIZER_KEY_FILE",
        default=DEFAULT_KEY,
        show_default=True,
        help="The authorizer's Ed25519 key (mode 0600). Env: AGORA_AUTHORIZER_KEY_FILE.",
    )(command)


def _db_option(command):
    return click.option(
        "--db",
        envvar="AGORA_AUTHORIZER_DB",
        help="sqlite:///PATH, a file path, or postgresql://... Default: authorizer.db next to the key. "
        "Env: AGORA_AUTHORIZER_DB.",
    )(_key_file_option(command))


def db_url(db: str | None, key_file: str) -> str:
    if db:
        return db
    return str(Path(key_file).expanduser().parent / "authorizer.db")


def open_store(db: str | None, key_file: str) -> Store:
    try:
        return Store.open(db_url(db, key_file))
    except StoreError as exc:
        fail(str(exc), code=1)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora-authorizer")
def main() -> None:
    """Decide who may join an Agora run, where they serve, and sign their credentials."""


@main.command()
@_key_file_option
def keygen(key_file: str) -> None:
    """Create the authorizer key if missing; print its public key (for the run config's
    [admission] authorizer_public_key)."""
    try:
        key = NodeKey.load_or_create(key_file)
    except AgoraError as exc:
        fail(str(exc))
    click.echo(f"public key {key.public_key.hex()}")
    click.echo(f"key file   {Path(key_file).expanduser()}")


@main.command()
@click.option(
    "--config", "config_file", required=True, type=click.Path(dir_okay=False), help="Run config TOML."
)
@_db_option
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="host:port to serve on.")
@click.option("--advertise", help="Address nodes should dial, if not the listen address.")
@click.option("--bootstrap", multiple=True, help="A DHT member of the run to join through (repeatable).")
@click.option(
    "--allow-local-build",
    is_flag=True,
    help="Add the agora packages installed here (versions and source digests) to the allowed software.",
)
@click.option("--log-format", type=click.Choice(["auto", "console", "json"]), default="auto")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0: any).")
@click.option("--metrics-host", help="Address to serve metrics on (default 127.0.0.1; $AGORA_METRICS_HOST).")
@click.option(
    "--metrics-push-gateway",
    help="Push metrics to this Prometheus push gateway (host:port or URL; $AGORA_METRICS_PUSH_GATEWAY).",
)
def serve(
    config_file, db, key_file, listen, advertise, bootstrap, allow_local_build, log_format, **metrics
) -> None:
    """Serve admissions for the run in --config until SIGINT/SIGTERM."""
    from agora_authorizer.service import Authorizer  # the store and RPC stack: only for serving

    node = resolve_node({"listen": listen, **metrics})  # the metrics knobs, over AGORA_METRICS_*
    run = load_config(config_file)
    configure_logging(fmt=log_format)
    if not run.admission.authorized:
        fail(f'{config_file}: [admission] mode is "open"; an authorizer serves runs with mode = "authorized"')
    try:
        key = NodeKey.load(key_file)
    except AgoraError as exc:
        fail(f"{exc} (agora-authorizer keygen creates one)")
    if key.public_key.hex() != (run.admission.authorizer_public_key or "").lower():
        fail(
            f"{config_file}: [admission] authorizer_public_key is not this key's ({key.public_key.hex()}); "
            "nodes would refuse its credentials"
        )
    extra = local_build() if allow_local_build else []
    store = open_store(db, key_file)
    try:
        authorizer = Authorizer(
            run=run,
            key=key,
            store=store,
            listen=listen,
            advertise=advertise,
            bootstrap=list(bootstrap),
            allowed_software=extra,
        )
        asyncio.run(_serve(authorizer, node))
    except (AgoraError, OSError) as exc:
        fail(str(exc), code=1)
    finally:
        store.close()


async def _serve(authorizer, node: NodeSettings) -> None:
    address = await authorizer.start()
    exposure = MetricsExposure.start(authorizer.metrics, node, run=authorizer.run.name)
    config = authorizer.config
    rate = (
        "no limit"
        if authorizer.bucket.unlimited
        else f"{config.admissions_per_minute:g}/min, burst {config.admission_burst}"
    )
    click.echo(f"agora-authorizer {__version__}: run {authorizer.run.name!r}")
    click.echo(f"  serving    {address}")
    settle_startup_heap()
    click.echo(f"  public key {authorizer.key.public_key.hex()}")
    click.echo(f"  database   {authorizer.store.url}")
    click.echo(f"  queue      {len(authorizer.queue)} waiting; admissions {rate}")
    software = authorizer.software
    click.echo(
        f"  software   {len(software.entries)} allowed builds"
        if software.enabled
        else "  software   any (check off)"
    )
    for line in exposure.describe():
        click.echo(line)
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await authorizer.stop()
        exposure.close(clean=stop.is_set())  # stopped as asked: its gateway group goes too
        click.echo("stopped")


@main.command()
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def status(db, key_file, as_json) -> None:
    """The queue, the nodes admitted per stage, the refusals by reason."""
    store = open_store(db, key_file)
    try:
        report = status_report(store, now=time.time())
    finally:
        store.close()
    click.echo(json.dumps(report, indent=1, default=str) if as_json else format_status(report))


@main.group()
def account() -> None:
    """Contributor accounts: every node joins under one."""


@account.command("add")
@click.argument("name")
@_db_option
@click.option("--token", help="The account's secret token (default: a new random one, printed).")
@click.option("--max-nodes", type=int, help="Most nodes this account may have in the run at once.")
def account_add(name, db, key_file, token, max_nodes) -> None:
    """Create account NAME and print its token (give it to the contributor)."""
    token = token or secrets.token_urlsafe(24)
    store = open_store(db, key_file)
    try:
        store.add_account(name, token, max_nodes=max_nodes, now=time.time())
    except AlreadyExists as exc:
        fail(str(exc), code=1)
    finally:
        store.close()
    click.echo(f"token {token}")


@account.command("list")
@_db_option
def account_list(db, key_file) -> None:
    store = open_store(db, key_file)
    try:
        for item in store.accounts():
            limit = "default limit" if item.max_nodes is None else f"at most {item.max_nodes} nodes"
            click.echo(f"{item.name}  ({limit})")
    finally:
        store.close()


def _kind_of(target: str, kind: str | None, store: Store) -> str:
    if kind:
        return kind
    if any(a.name == target for a in store.accounts()):
        return "account"
    if NODE_ID.match(target):
        return "node"
    fail(f"{target!r} is neither an account nor a 40-hex-digit node id (say which with --kind)")


@main.command()
@click.argument("target")
@_db_option
@click.option(
    "--kind", type=click.Choice(["node", "account"]), help="Default: an account if one has that name."
)
@click.option("--reason", default="banned by the operator", show_default=True)
def ban(target, db, key_file, kind, reason) -> None:
    """Ban a node or a whole account: its credentials are revoked, its next refresh is
    refused, and the DHT's revocation list names it within one refresh period."""
    store = open_store(db, key_file)
    try:
        kind = _kind_of(target, kind, store)
        now = time.time()
        store.ban(kind, target, reason=reason, now=now)
        revoked = (
            store.revoke_node(target, now=now) if kind == "node" else store.revoke_account(target, now=now)
        )
    finally:
        store.close()
    click.echo(f"banned {kind} {target}: {revoked} credentials revoked")


@main.command()
@click.argument("target")
@_db_option
@click.option("--kind", type=click.Choice(["node", "account"]))
def unban(target, db, key_file, kind) -> None:
    """Lift a ban (the node joins again through the checks)."""
    store = open_store(db, key_file)
    try:
        kind = _kind_of(target, kind, store)
        lifted = store.unban(kind, target)
    finally:
        store.close()
    click.echo(f"{'lifted the ban on' if lifted else 'no ban on'} {kind} {target}")


@main.command()
@_db_option
@click.option("--node", "node_id", help="Only the accusations against this node id.")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    help="The run config: judge with its anchor_accounts and revoke_after_accusers.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def accusations(db, key_file, node_id, config_file, as_json) -> None:
    """Every accusation recorded, by accused node: its ban and pardon, its independent
    accusers, and for each accusation whether it counts toward a revocation (and if not, why)."""
    anchors, revoke_after, anchor_checks = (), None, False
    if config_file:
        run = load_config(config_file)
        anchors, revoke_after = run.admission.anchor_accounts, run.admission.revoke_after_accusers
        anchor_checks = run.admission.revoke_on_anchor_spot_check
    store = open_store(db, key_file)
    try:
        report = accusations_report(
            store,
            now=time.time(),
            node=node_id,
            anchors=anchors,
            revoke_after=revoke_after,
            anchor_checks=anchor_checks,
        )
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(report, indent=1))
    elif not report["accused"]:
        click.echo(
            f"no accusations recorded{f' against {node_id}' if node_id else ''} in {report['database']}"
        )
    else:
        click.echo(format_accusations(report))


@main.command()
@click.argument("node_id")
@_db_option
def pardon(node_id, db, key_file) -> None:
    """Lift NODE_ID's ban and forgive the accusations made against it so far: only
    accusations made after the pardon count toward a revocation again. Exits 1 when there
    is nothing to pardon (not banned, and not accused since its last pardon)."""
    if not NODE_ID.match(node_id):
        fail(f"{node_id!r} is not a node id (40 hex digits: agora-authorizer accusations lists them)")
    store = open_store(db, key_file)
    try:
        done = store.pardon(node_id, now=time.time())
    finally:
        store.close()
    if done.pardoned is None:
        fail(f"nothing to pardon: node {node_id} is not banned and not accused since its last pardon", code=1)
    lifted = f"lifted its ban ({done.ban_reason})" if done.ban_reason is not None else "it was not banned"
    click.echo(f"pardoned node {node_id}: {lifted}; {done.forgiven} accusations forgiven")
    if done.ban_reason is not None:
        click.echo(
            "its credentials stay revoked: it joins again through the checks, and the DHT "
            "revocation list names it until they expire"
        )


@main.command()
@click.argument("node_id")
@click.argument("stage", type=int)
@_db_option
def pin(node_id, stage, db, key_file) -> None:
    """Place worker NODE_ID on STAGE whenever it joins (instead of the least-provisioned stage)."""
    if not NODE_ID.match(node_id):
        fail(f"{node_id!r} is not a node id (40 hex digits: agora keygen prints it)")
    if stage < 0:
        fail("a stage is >= 0")
    store = open_store(db, key_file)
    try:
        store.pin(node_id, stage, now=time.time())
    finally:
        store.close()
    click.echo(f"pinned {node_id} to stage {stage}")


@main.command()
@click.argument("node_id")
@_db_option
def unpin(node_id, db, key_file) -> None:
    store = open_store(db, key_file)
    try:
        removed = store.unpin(node_id)
    finally:
        store.close()
    click.echo(f"{'unpinned' if removed else 'no pin for'} {node_id}")


@main.command()
def software() -> None:
    """Print [admission] allowed_software entries for the agora packages installed here."""
    for entry in local_build():
        click.echo(json.dumps(entry))


cli_credential.register(main, _db_option, open_store)
