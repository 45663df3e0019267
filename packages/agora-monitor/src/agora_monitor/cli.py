"""``agora-monitor``: watch a run and serve its dashboard.

    agora-monitor serve --config RUN.toml --bootstrap DHT_ADDR [--db URL] [--http HOST:PORT]
                        [--credential FILE --key-file KEY] [--period-s 5]
    agora-monitor dashboard --db URL [--http HOST:PORT]   # the dashboard of a database alone

``serve`` joins the run's DHT as a light member, writes a snapshot of what the run publishes
every ``--period-s`` into the database (SQLite by default, PostgreSQL with
``--db postgresql://...``) and serves the dashboard and its JSON API on ``--http``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys

import click

from agora_core.config import NodeSettings
from agora_core.errors import AgoraError, ConfigError
from agora_core.identity import NodeKey
from agora_core.node.heap import settle_startup_heap
from agora_core.node.options import fail, load_config, resolve_node
from agora_core.observability.logs import configure_logging, get_logger
from agora_core.observability.metrics_exposure import MetricsExposure
from agora_monitor import __version__
from agora_monitor.observer import join, observer_node
from agora_monitor.service import Monitor
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore
from agora_monitor.web import make_app, start_site

DEFAULT_DB = "monitor.db"
DEFAULT_HTTP = "127.0.0.1:8470"
log = get_logger("monitor.cli")


def parse_http(value: str) -> tuple[str, int]:
    """HOST:PORT for the dashboard; ConfigError naming --http otherwise."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(
            "--http", f"{value!r} is not HOST:PORT (e.g. {DEFAULT_HTTP}; port 0 picks a free one)"
        )
    return host.strip("[]"), int(port)


def _settings_options(command):
    """A flag for every field of MonitorSettings, its default shown."""
    defaults = MonitorSettings()
    helps = {
        "period_s": "Seconds between snapshots of the DHT (the dashboard polls as often).",
        "stall_after_s": "Alert when a stage's step has not moved for this many seconds.",
        "min_workers": "Alert when a stage has fewer serving workers than this.",
        "alert_window_s": "How long departures, lost workers and flagged records keep alerting (s).",
        "loss_spike_ratio": "Alert when the loss passes this times its recent level (in the alert window).",
        "loss_spike_window": "Snapshots per median when taking that level.",
        "rate_slack": "Flag a node whose samples/s pass its announced throughput times this.",
        "reconcile_tolerance": "Flag a stage whose samples differ from the trainers' by more than this fraction ...",
        "reconcile_batches": "... plus this many target batches.",
    }
    for field in reversed(dataclasses.fields(MonitorSettings)):
        kind = int if field.type in (int, "int") else float
        command = click.option(
            f"--{field.name.replace('_', '-')}", field.name, type=kind, default=getattr(defaults, field.name),
            show_default=True, help=helps[field.name],
        )(command)  # fmt: skip
    return command


def _db_option(command):
    return click.option(
        "--db", default=DEFAULT_DB, show_default=True, envvar="AGORA_MONITOR_DB",
        help="sqlite:///PATH, a file path ending in .db, or postgresql://user@host/dbname. Env: AGORA_MONITOR_DB.",
    )(command)  # fmt: skip


def _http_option(command):
    return click.option(
        "--http",
        default=DEFAULT_HTTP,
        show_default=True,
        help="HOST:PORT the dashboard serves on (port 0: any free one).",
    )(command)


def _settings(options: dict) -> MonitorSettings:
    names = {f.name for f in dataclasses.fields(MonitorSettings)}
    try:
        return MonitorSettings(**{k: v for k, v in options.items() if k in names})
    except ConfigError as exc:
        fail(str(exc))


def _open_store(db: str) -> MonitorStore:
    try:
        return MonitorStore(db)
    except AgoraError as exc:
        fail(str(exc), code=1)


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora-monitor")
def main() -> None:
    """Agora's health monitor: a run's history in a database, and its live dashboard."""


async def _serve(
    run,
    store: MonitorStore,
    settings: MonitorSettings,
    http: tuple[str, int],
    node_args: dict,
    node_settings: NodeSettings,
) -> None:
    member = observer_node(run, **node_args)
    node, metrics = member.node, member.metrics
    address = await join(node, node_args["bootstrap"])
    monitor = Monitor(run=run, store=store, dht=node.dht, settings=settings, metrics=metrics)
    runner = exposure = None
    stopped = False
    try:
        await monitor.restore()
        runner, url = await start_site(make_app(store, settings), *http)
        exposure = MetricsExposure.start(metrics, node_settings, run=run.name)
        click.echo(f"agora monitor {node.key.node_id}")
        click.echo(f"  run        {run.name} ({run.model.n_stages} stages)")
        click.echo(f"  database   {store.url}")
        click.echo(f"  serving    {address}")
        settle_startup_heap()
        click.echo(f"  dashboard  {url}")
        for line in exposure.describe():
            click.echo(line)
        sys.stdout.flush()
        loop_task = asyncio.get_running_loop().create_task(monitor.run_forever(), name="monitor-snapshots")
        try:
            await _until_stopped()
            stopped = True
        finally:
            loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop_task
    finally:
        if runner is not None:
            await runner.cleanup()
        await node.stop()
        monitor.close()
        if exposure is not None:
            exposure.close(clean=stopped)  # stopped as asked: its gateway group goes too
        click.echo("stopped")


@main.command()
@click.option(
    "--config", "config_file", required=True, type=click.Path(dir_okay=False), help="The run config TOML."
)
@click.option(
    "--bootstrap",
    multiple=True,
    required=True,
    help="A DHT member to join through (repeatable); <hex key>@host:port in an authorized run.",
)
@_db_option
@_http_option
@click.option(
    "--key-file", help="The monitor's node key (created if missing; default: a fresh key each start)."
)
@click.option(
    "--credential",
    "credential_file",
    type=click.Path(dir_okay=False),
    help="Its credential, in an authorized run (agora-authorizer credential --role monitor).",
)
@click.option(
    "--listen", default="127.0.0.1:0", show_default=True, help="host:port its DHT member serves on."
)
@click.option("--advertise", help="Address other members should dial, if not the listen address.")
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    default="auto",
    show_default=True,
    help="Log lines for humans or machines.",
)
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0: any).")
@click.option("--metrics-host", help="Address to serve metrics on (default 127.0.0.1; $AGORA_METRICS_HOST).")
@click.option(
    "--metrics-push-gateway",
    help="Push metrics to this Prometheus push gateway (host:port or URL; $AGORA_METRICS_PUSH_GATEWAY).",
)
@_settings_options
def serve(
    config_file, bootstrap, db, http, key_file, credential_file, listen, advertise, log_format, **options
) -> None:
    """Join the run's DHT, snapshot it into the database, and serve the dashboard."""
    metric_names = ("metrics_port", "metrics_host", "metrics_push_gateway")
    # the metrics knobs, over AGORA_METRICS_*; --listen is the DHT member's, checked there
    node_settings = resolve_node({name: options.pop(name) for name in metric_names})
    configure_logging(fmt=log_format, level="info")
    settings = _settings(options)
    run = load_config(config_file)
    try:
        address = parse_http(http)
        key = NodeKey.load_or_create(key_file) if key_file else NodeKey.generate()
    except AgoraError as exc:
        fail(str(exc))
    store = _open_store(db)
    node_args = {
        "key": key,
        "bootstrap": list(bootstrap),
        "credential_file": credential_file,
        "listen": listen,
        "advertise": advertise,
    }
    try:
        asyncio.run(_serve(run, store, settings, address, node_args, node_settings))
    except ConfigError as exc:
        fail(str(exc))
    except (AgoraError, OSError) as exc:
        fail(str(exc), code=1)
    finally:
        store.close()


async def _dashboard(store: MonitorStore, settings: MonitorSettings, http: tuple[str, int]) -> None:
    runner, url = await start_site(make_app(store, settings), *http)
    click.echo(f"  database   {store.url}")
    click.echo(f"  dashboard  {url}")
    sys.stdout.flush()
    try:
        await _until_stopped()
    finally:
        await runner.cleanup()


@main.command()
@_db_option
@_http_option
@_settings_options
def dashboard(db, http, **options) -> None:
    """Serve the dashboard of a database alone (no DHT, no new snapshots): a past run's."""
    configure_logging(fmt="auto", level="info")
    settings = _settings(options)
    try:
        address = parse_http(http)
    except ConfigError as exc:
        fail(str(exc))
    store = _open_store(db)
    try:
        asyncio.run(_dashboard(store, settings, address))
    except OSError as exc:
        fail(str(exc), code=1)
    finally:
        store.close()
