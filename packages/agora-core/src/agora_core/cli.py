"""The ``agora`` command: keys, config checks, and a standalone RPC node."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import click
import numpy as np

from agora_core import __version__
from agora_core.admission.credential_file import load_credential
from agora_core.admission.revocations import parse_revocations, revocations_key
from agora_core.config import NodeSettings
from agora_core.config.unimplemented import NOT_IMPLEMENTED
from agora_core.config.vocabulary import vocabulary_fit
from agora_core.contract import Method
from agora_core.errors import AgoraError, ConfigError
from agora_core.identity import NodeKey
from agora_core.injection.cli import inject
from agora_core.node.heap import settle_startup_heap
from agora_core.node.options import (
    fail,
    load_config,
    node_options,
    resolve_node,
    status_interval_option,
)
from agora_core.node.run_node import RunNode
from agora_core.observability.logs import configure_logging, get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.observability.metrics_exposure import MetricsExposure
from agora_core.rpc import Payload, Request, RpcClient, RpcServer
from agora_core.rpc.linkemu import LinkEmulator


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="agora")
def main() -> None:
    """Agora: decentralized LLM pretraining over unreliable, heterogeneous GPUs."""


main.add_command(inject)


@main.command()
@click.option(
    "--key-file", type=click.Path(dir_okay=False), help="Default: $AGORA_KEY_FILE or ~/.agora/node.key."
)
@click.option("--force", is_flag=True, help="Replace an existing key file (the old identity is lost).")
def keygen(key_file: str | None, force: bool) -> None:
    """Create an Ed25519 node key (mode 0600) and print the node id."""
    try:
        settings = NodeSettings.resolve({"key_file": key_file})
        if Path(settings.key_file).expanduser().exists() and not force:
            fail(f"key file {settings.key_file} already exists; --force replaces it (and its identity)")
        path = NodeKey.generate().save(settings.key_file, overwrite=force)
        key = NodeKey.load(path)
    except AgoraError as exc:
        fail(str(exc))
    click.echo(f"node id:    {key.node_id}")
    click.echo(f"public key: {key.public_key.hex()}")
    click.echo(f"key file:   {path}")


@main.group()
def config() -> None:
    """Run config tools."""


@config.command("check")
@click.argument("file", type=click.Path(dir_okay=False))
def config_check(file: str) -> None:
    """Validate a run config TOML and summarize it.

    Keys the code does not act on yet are listed; a config that sets one is refused."""
    run = load_config(file)
    try:  # a model with fewer rows than the tokenizer has ids cannot embed every token
        fit = vocabulary_fit(run)
    except ConfigError as exc:
        fail(f"{file}: {exc}")
    m = run.model
    click.echo(f"{file}: ok")
    click.echo(f"  run        {run.name} (seed {run.seed})")
    click.echo(
        f"  model      {m.kind}, d={m.d_model}, k={m.subspace_rank}, heads={m.n_heads}, "
        f"vocab={m.vocab_size}, seq={m.seq_len}"
    )
    click.echo(f"  stages     {m.n_stages} with blocks {list(m.stage_layers)}")
    click.echo(f"  tokenizer  {run.data.tokenizer}: {fit.tokenizer_ids} ids, {fit.model_rows} model rows")
    if fit.warning:
        click.echo(f"  warning    {fit.warning}")
    o = run.optimizer
    click.echo(
        f"  optimizer  AdamW lr={o.lr:g}, warmup={o.warmup_steps}, steps={o.total_steps}, "
        f"batch={o.target_batch_size} samples"
    )
    a = run.averaging
    click.echo(
        f"  averaging  {'on' if a.enabled else 'off'}: 1/{a.segments} of weights every "
        f"{a.cadence_steps} steps, window {a.matchmaking_window_s:g} s, timeout {a.round_timeout_s:g} s"
    )
    click.echo(f"  admission  {run.admission.mode}")
    click.echo("  not implemented yet (refused unless left at their defaults):")
    for key, why in NOT_IMPLEMENTED.items():
        click.echo(f"    {key}: {why}")


# --- a standalone node ----------------------------------------------------------------------


def _ping(request: Request) -> Payload:
    return Payload({"pong": True, "time": time.time()})


def _echo(request: Request) -> Payload:
    return Payload(request.meta, request.tensors)


async def _self_check(address: str, link: LinkEmulator | None) -> None:
    """Call the node like a peer would, and print what it measured."""
    async with RpcClient(link=link) as client:
        await client.call(address, Method.PING)
        rtts = []
        for _ in range(200):
            t0 = time.perf_counter()
            await client.call(address, Method.PING)
            rtts.append(time.perf_counter() - t0)
        click.echo(f"self-check: ping round trip p50 {np.median(rtts) * 1e6:.0f} us over {len(rtts)} calls")
        tensor = np.random.default_rng(0).standard_normal(8 << 20, dtype=np.float32)  # 32 MiB
        t0 = time.perf_counter()
        reply = await client.call(address, Method.ECHO, {"what": "32 MiB float32"}, {"x": tensor})
        elapsed = time.perf_counter() - t0
        ok = np.array_equal(reply.tensors["x"], tensor)
        click.echo(
            f"self-check: echoed 32 MiB tensor in {elapsed * 1e3:.0f} ms "
            f"({2 * tensor.nbytes / elapsed / 1e9:.2f} GB/s both ways), intact: {ok}"
        )


async def _serve(settings: NodeSettings, duration_s: float | None, self_check: bool) -> None:
    log = get_logger("node")
    key = NodeKey.generate()
    metrics = NodeMetrics(role="node", instance=key.node_id[:12])
    link = settings.link_emulator()
    server = RpcServer(listen=settings.listen, link=link, metrics=metrics, node_id=key.node_id)
    server.register(Method.PING, _ping)
    server.register(Method.ECHO, _echo)
    address = await server.start()
    exposure = MetricsExposure.start(metrics, settings, run="")  # a standalone node is in no run
    click.echo(f"agora node {key.node_id}")
    click.echo(f"  serving    {address}")
    settle_startup_heap()
    click.echo(f"  methods    {', '.join(server.methods)}")
    for line in exposure.describe():
        click.echo(line)
    if link is not None:
        click.echo(f"  link       {settings.link}")
    log.info("node_started", address=address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    clean = False  # a failure on the way keeps its last metrics on the gateway
    try:
        if self_check:
            await _self_check(address, link)
        if duration_s is None:
            click.echo("serving until Ctrl-C")
            await stop.wait()
        else:
            click.echo(f"serving for {duration_s:g} s (Ctrl-C stops earlier)")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(duration_s, 0.0)):
                    await stop.wait()
        clean = True
    finally:
        await server.stop(grace_s=2.0)
        exposure.close(clean=clean)
        log.info("node_stopped", address=address)
        click.echo("stopped")


@main.command()
@click.option("--listen", help="host:port to serve on (default 127.0.0.1:0, a free port).")
@click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0: any).")
@click.option("--link", help='Emulate a link, e.g. "up=100M,down=100M,latency=40ms,jitter=5ms".')
@click.option("--log-format", type=click.Choice(["auto", "console", "json"]))
@click.option("--duration", "duration_s", type=float, help="Stop after this many seconds.")
@click.option("--self-check", is_flag=True, help="Call the node once started and print figures.")
def serve(listen, metrics_port, link, log_format, duration_s, self_check) -> None:
    """Run a standalone Agora RPC node (ping, echo) and print what it serves."""
    try:
        settings = NodeSettings.resolve(
            {"listen": listen, "metrics_port": metrics_port, "link": link, "log_format": log_format}
        )
    except ConfigError as exc:
        fail(str(exc))
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    try:
        asyncio.run(_serve(settings, duration_s, self_check))
    except OSError as exc:
        fail(str(exc), code=1)


# --- the DHT ---------------------------------------------------------------------------------


@main.group()
def dht() -> None:
    """The run's gossip DHT."""


async def _serve_dht(
    settings: NodeSettings, run, bootstrap, status_interval_s: float, duration_s, credential_file
) -> None:
    log = get_logger("dht.cli")
    key = NodeKey.load_or_create(settings.key_file)
    metrics = NodeMetrics(role="dht", instance=key.node_id[:12])
    credential = None
    if run.admission.authorized:
        if not credential_file:
            raise ConfigError(
                "--credential",
                "a DHT node of an authorized run needs its credential "
                "(agora-authorizer credential --role dht --node-key KEY --out FILE)",
            )
        credential = load_credential(
            credential_file,
            authorizer_public_key=run.admission.authorizer_key_bytes,
            run=run.name,
            public_key=key.public_key,
        )
    run_node = RunNode(
        run=run,
        key=key,
        metrics=metrics,
        listen=settings.listen,
        advertise=settings.advertise,
        bootstrap=bootstrap,
        link=settings.link_emulator(),
        credential=credential,
    )
    node = run_node.dht
    address = await run_node.start()
    exposure = MetricsExposure.start(metrics, settings, run=run.name)
    click.echo(f"agora dht node {key.node_id}")
    click.echo(f"  serving    {address}", nl=True)
    settle_startup_heap()
    click.echo(f"  bootstrap  {key.public_key.hex()}@{address}")  # what other nodes pass --bootstrap
    click.echo(f"  members    {len(node.members())}")
    for line in exposure.describe():
        click.echo(line)
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    last_ops, last_traffic, last_t = 0, node.traffic(), started
    clean = False  # a failure on the way keeps its last metrics on the gateway
    try:
        while not stop.is_set():
            wait = status_interval_s
            if duration_s is not None:
                wait = min(wait, max(0.0, started + duration_s - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait):
                    await stop.wait()
            now = time.monotonic()
            ops = node.ops_done
            traffic = node.traffic()
            latencies = sorted(seconds for _op, seconds in node.recent_ops)
            log.info(
                "dht_status",
                members=len(node.members()),
                records=len(node.records),
                ops_per_s=round((ops - last_ops) / max(now - last_t, 1e-9), 1),
                op_p50_ms=round(latencies[len(latencies) // 2] * 1e3, 2) if latencies else None,
                messages_per_s=round((traffic[0] - last_traffic[0]) / max(now - last_t, 1e-9), 1),
                bytes_per_s=round((traffic[1] - last_traffic[1]) / max(now - last_t, 1e-9)),
            )
            last_ops, last_traffic, last_t = ops, traffic, now
            if run_node.security is not None:  # drop peers the authorizer banned
                with contextlib.suppress(AgoraError, TimeoutError):
                    found = await node.get(revocations_key(run.name))
                    run_node.observe_revocations(parse_revocations(found, run.admission.authorizer_key_bytes))
            if duration_s is not None and now - started >= duration_s:
                break
        clean = True
    finally:
        await run_node.stop()
        exposure.close(clean=clean)
        click.echo("stopped")


@dht.command("serve")
@node_options
@click.option(
    "--config", "config_file", type=click.Path(dir_okay=False), help="Run config TOML (its [dht] section)."
)
@status_interval_option("status log lines")
@click.option("--duration", "duration_s", type=float, help="Leave and stop after this many seconds.")
@click.option(
    "--credential",
    "credential_file",
    type=click.Path(dir_okay=False),
    help="This node's credential file, in an authorized run (agora-authorizer credential --role dht).",
)
def dht_serve(config_file, status_interval_s, duration_s, bootstrap, credential_file, **options) -> None:
    """Run a DHT node (a seed when --bootstrap is not given) until Ctrl-C."""
    settings = resolve_node(options)
    run = load_config(config_file)
    configure_logging(fmt=settings.log_format, level=settings.log_level)
    try:
        asyncio.run(
            _serve_dht(settings, run, list(bootstrap), status_interval_s, duration_s, credential_file)
        )
    except (OSError, AgoraError) as exc:
        fail(str(exc), code=1)
