"""Command-line options every Agora node shares, for the role CLIs built on click.

``@node_options`` adds ``--listen --advertise --bootstrap --key-file --metrics-port
--metrics-host --metrics-push-gateway --link --log-format --authorizer --account
--account-token`` to a command; :func:`resolve_node` turns what the user gave into
:class:`NodeSettings` (flags over ``AGORA_*`` variables over defaults), and :func:`fail`
prints an expected failure as one line instead of a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import click

from agora_core.config import NodeSettings, RunConfig, load_run_config, resolve_settings
from agora_core.errors import ConfigError
from agora_core.node.allocator import tune_for_large_messages
from agora_core.observability.logs import configure_logging

S = TypeVar("S")
NODE_OPTIONS = (
    "listen",
    "advertise",
    "key_file",
    "metrics_port",
    "metrics_host",
    "metrics_push_gateway",
    "link",
    "log_format",
    "authorizer",
    "account",
    "account_token",
)

_OPTIONS = [
    click.option("--listen", help="host:port to serve on (default 127.0.0.1:0, a free port)."),
    click.option("--advertise", help="Address others should dial, if not the listen address."),
    click.option("--bootstrap", multiple=True, help="Address of a DHT member to join through (repeatable)."),
    click.option(
        "--key-file", help="Node key (created if missing). Default: $AGORA_KEY_FILE or ~/.agora/node.key."
    ),
    click.option("--metrics-port", type=int, help="Serve Prometheus metrics on this port (0: any)."),
    click.option(
        "--metrics-host", help="Address to serve metrics on (default 127.0.0.1; $AGORA_METRICS_HOST)."
    ),
    click.option(
        "--metrics-push-gateway",
        help="Push metrics to this Prometheus push gateway, host:port or URL, every "
        "$AGORA_METRICS_PUSH_INTERVAL_S seconds (default 15) ($AGORA_METRICS_PUSH_GATEWAY).",
    ),
    click.option("--link", help='Emulate a link, e.g. "up=100M,down=100M,latency=40ms".'),
    click.option("--log-format", type=click.Choice(["auto", "console", "json"])),
    click.option(
        "--authorizer",
        help='The authorizer\'s address, for a run whose [admission] mode is "authorized" ($AGORA_AUTHORIZER).',
    ),
    click.option("--account", help="The account this node joins under ($AGORA_ACCOUNT)."),
    click.option(
        "--account-token",
        help="The account's token; better as $AGORA_ACCOUNT_TOKEN (a flag shows in the process list).",
    ),
]


def status_interval_option(what: str = "status lines") -> Callable:
    """``--status-interval`` (seconds, default 10) for commands that print how they are doing."""
    return click.option(
        "--status-interval",
        "status_interval_s",
        type=float,
        default=10.0,
        show_default=True,
        help=f"Seconds between {what}.",
    )


def load_config(path: str | None) -> RunConfig:
    """The run config at ``path`` (defaults without one); a bad file exits with its error."""
    try:
        return load_run_config(path) if path else RunConfig()
    except ConfigError as exc:
        message = str(exc)
        fail(message if path in message else f"{path}: {message}")


def settings_from_flags(cls: type[S], role: str, **flags: Any) -> S:
    """A role's settings dataclass from a command's flags, over ``AGORA_<ROLE>_<FIELD>``
    variables, over the class defaults (flags not given are None); a rejected value exits with
    its error."""
    try:
        return resolve_settings(cls, flags, prefix=f"AGORA_{role.upper()}_")
    except ConfigError as exc:
        fail(str(exc))


def node_options(command: Callable) -> Callable:
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def fail(message: str, code: int = 2) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def launch_role(
    role: str, options: dict[str, Any], config_file: str | None, settings_cls: type[S]
) -> tuple[NodeSettings, RunConfig, S]:
    """What a role's ``run`` command does first: the node settings (from the ``@node_options``
    among ``options``), the run config, the role's own settings (from the other options, named
    as ``settings_cls``'s fields, and ``AGORA_<ROLE>_*`` variables), each error exiting with its
    message (an authorizer given to an open run, or none to an authorized one, too); then
    :func:`prepare_process`."""
    flags = {name: value for name, value in options.items() if name not in NODE_OPTIONS}
    node = resolve_node(options)
    run = load_config(config_file)
    try:
        node.check_admission(run.admission)
    except ConfigError as exc:
        fail(str(exc))
    settings = settings_from_flags(settings_cls, role, **flags)
    prepare_process(node)
    return node, run, settings


def prepare_process(node: NodeSettings) -> None:
    """Set up the process of a node that moves tensors: its logging, and malloc's thresholds
    (chunk-sized buffers reused on the heap, not faulted in afresh; ``agora_core.node.allocator``).
    Call it before the node starts threads."""
    configure_logging(fmt=node.log_format, level=node.log_level)
    tune_for_large_messages()


def resolve_node(options: dict[str, Any]) -> NodeSettings:
    """NodeSettings from a command's node options, over ``AGORA_*`` variables."""
    try:
        return NodeSettings.resolve({name: options.get(name) for name in NODE_OPTIONS})
    except ConfigError as exc:
        fail(str(exc))
