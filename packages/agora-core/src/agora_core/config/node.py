"""Node-local settings: what differs per machine, never per run.

Precedence, lowest first: defaults, ``AGORA_<NAME>`` environment variables, CLI flags. The
same rule builds a role's own settings dataclass (``resolve_settings``), whose variables carry
the role in their prefix (``AGORA_WORKER_DEVICE``) so one environment can hold every role's.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from agora_core.config.admission import AdmissionConfig
from agora_core.config.loader import build, coerce, field_types, require
from agora_core.errors import ConfigError
from agora_core.observability.metrics_push import GatewayAddressError, gateway_url
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator

ENV_PREFIX = "AGORA_"
S = TypeVar("S")


def resolve_settings(
    cls: type[S],
    flags: Mapping[str, Any] | None = None,
    *,
    prefix: str = ENV_PREFIX,
    environ: Mapping[str, str] | None = None,
) -> S:
    """Settings dataclass ``cls``: defaults, overridden by ``<prefix><FIELD>`` variables,
    overridden by non-None ``flags``. A bad value raises ConfigError naming the field."""
    environ = os.environ if environ is None else environ
    from_env: dict[str, Any] = {}
    for name, tp in field_types(cls).items():
        variable = prefix + name.upper()
        if (raw := environ.get(variable)) is not None:
            from_env[name] = coerce(tp, raw, variable, from_string=True)
    chosen = {**from_env, **{k: v for k, v in (flags or {}).items() if v is not None}}
    return build(cls, chosen)


def default_key_file() -> str:
    return str(Path("~/.agora/node.key").expanduser())


@dataclass(kw_only=True, frozen=True)
class NodeSettings:
    listen: str = "127.0.0.1:0"  # host:port to serve RPC on; port 0 picks a free port
    advertise: str | None = None  # address others should dial, when it differs from listen
    key_file: str = dataclasses.field(default_factory=default_key_file)
    metrics_port: int | None = None  # serve Prometheus /metrics on this port (0: any free)
    # ...on this address: loopback unless an operator opens it (0.0.0.0: every interface)
    metrics_host: str = "127.0.0.1"
    # push to this Prometheus push gateway (host:port or http(s)://host:port) periodically
    metrics_push_gateway: str | None = None
    metrics_push_interval_s: float = 15.0  # between pushes (Prometheus's usual scrape interval)
    log_format: Literal["auto", "console", "json"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    link: str | None = None  # emulated link, e.g. "up=200M,down=200M,latency=50ms,jitter=5ms"
    # --- admission (a run whose [admission] mode is "authorized") ------------------------
    authorizer: str | None = None  # the authorizer's address (host:port or tcp://host:port)
    account: str | None = None  # the contributor account the node joins under
    # Its token: best given as AGORA_ACCOUNT_TOKEN (a flag shows in the process list).
    account_token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        host, sep, port = self.listen.rpartition(":")
        require(bool(sep and host) and port.isdigit(), "listen", f"expected host:port, got {self.listen!r}")
        require(
            self.metrics_port is None or 0 <= self.metrics_port < 65536,
            "metrics_port",
            "must lie in [0, 65535]",
        )
        require(bool(self.metrics_host.strip()), "metrics_host", "must not be empty")
        if self.metrics_push_gateway is not None:
            try:
                gateway_url(self.metrics_push_gateway)
            except GatewayAddressError as exc:
                require(False, "metrics_push_gateway", str(exc))
        require(self.metrics_push_interval_s > 0, "metrics_push_interval_s", "must be > 0")
        require(self.authorizer is None or bool(self.authorizer.strip()), "authorizer", "must not be empty")
        if self.link is not None:
            try:
                LinkConfig.parse(self.link)
            except ValueError as exc:
                require(False, "link", str(exc))

    def check_admission(self, admission: AdmissionConfig) -> None:
        """ConfigError unless these settings fit the run's admission mode: an authorized run
        needs the authorizer's address, an open run has no authorizer (the run config is the
        contract; a node does not choose its own admission)."""
        if admission.authorized and self.authorizer is None:
            raise ConfigError(
                "authorizer",
                'the run config says [admission] mode = "authorized": give the authorizer\'s address '
                "with --authorizer HOST:PORT (or AGORA_AUTHORIZER), and an account with --account "
                "and AGORA_ACCOUNT_TOKEN",
            )
        if not admission.authorized and self.authorizer is not None:
            raise ConfigError(
                "authorizer",
                f"--authorizer {self.authorizer} was given, but the run config's [admission] mode is "
                f"{admission.mode!r}: an open run has no authorizer (drop --authorizer, or use the "
                'run config with mode = "authorized" that the authorizer was started with)',
            )

    @property
    def link_config(self) -> LinkConfig | None:
        return LinkConfig.parse(self.link) if self.link else None

    def link_emulator(self) -> LinkEmulator | None:
        """A new emulator of the configured link for this node's sockets (None: a real link)."""
        config = self.link_config
        return LinkEmulator(config) if config else None

    @classmethod
    def resolve(
        cls,
        flags: Mapping[str, Any] | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> NodeSettings:
        """Defaults, overridden by ``AGORA_*`` variables, overridden by non-None ``flags``."""
        return resolve_settings(cls, flags, environ=environ)
