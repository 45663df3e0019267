"""Periodic, best-effort pushes of a node's metrics to a Prometheus push gateway.

Contributors behind NAT cannot be scraped, so they push (``AGORA_METRICS_PUSH_GATEWAY``).
A :class:`MetricsPusher` pushes the node's registry at once, then every ``interval_s``, from a
thread of its own: a gateway that is slow, refuses, or goes away costs that thread one timed-out
request per interval and never touches the node's event loop or compute. Failures are
counted (``agora_metrics_pushes_total{outcome="failed"}``) and logged once per outage, never
raised.

A node's group on the gateway is keyed by ``job``, ``run``, ``role`` and ``instance`` (not the
stage: a worker of an authorized run learns it after it starts pushing, and a key that changed
would leave its old group behind). On a clean exit the node deletes its group, so the gateway
holds only live nodes and nodes that stopped abnormally; a node that terminated itself pushes
once more and keeps its group, so an alert can say why it left.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Callable

from prometheus_client.exposition import delete_from_gateway, push_to_gateway

from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics

log = get_logger("metrics.push")
DEFAULT_JOB = "agora"
PUSH_TIMEOUT_S = 5.0  # one push or delete; an interval's push never waits longer than this


class GatewayAddressError(ValueError):
    """A push gateway address that is not ``host:port`` or an ``http(s)://host:port`` URL."""


def gateway_url(address: str) -> str:
    """The push gateway's base URL from ``host:port`` or ``http(s)://host:port[/prefix]``;
    GatewayAddressError saying what is wrong, so a typo fails at startup, not at each push."""
    raw = address.strip()
    if not raw:
        raise GatewayAddressError("the push gateway address is empty (leave it unset to push nowhere)")
    url = raw if "://" in raw else f"http://{raw}"
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https"):
        raise GatewayAddressError(f"{address!r}: a push gateway is reached over http or https")
    try:
        port = parsed.port  # raises on a port that is not a number in range
    except ValueError:
        raise GatewayAddressError(f"{address!r}: the port must be a number in [1, 65535]") from None
    if not parsed.hostname or port is None or port == 0:
        raise GatewayAddressError(
            f"{address!r}: expected host:port (e.g. 127.0.0.1:9091) or http://host:port"
        )
    if parsed.query or parsed.fragment:
        raise GatewayAddressError(f"{address!r}: a gateway address has no query or fragment")
    return url.rstrip("/")


class MetricsPusher:
    """Pushes one node's metrics to a gateway every ``interval_s`` until :meth:`close`."""

    def __init__(
        self,
        metrics: NodeMetrics,
        gateway: str,
        *,
        run: str,
        interval_s: float,
        timeout_s: float = PUSH_TIMEOUT_S,
        job: str = DEFAULT_JOB,
    ):
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s} and {timeout_s}")
        self.url = gateway_url(gateway)
        self.job, self.interval_s, self.timeout_s = job, interval_s, timeout_s
        self._metrics = metrics
        self._run = run
        self._pushes = metrics.counter(
            "agora_metrics_pushes_total", "Pushes to the metrics gateway, by outcome.", ["outcome"]
        )
        for outcome in ("ok", "failed"):  # both series from the start: a rate over them is defined
            self._pushes.labels(outcome=outcome)
        self._stop = threading.Event()
        self._delete = False
        self._failing = False  # logged once per outage, not once per interval
        self._thread = threading.Thread(target=self._run_pushes, name="metrics-push", daemon=True)

    @property
    def grouping_key(self) -> dict[str, str]:
        """The node's group on the gateway (besides ``job``); empty labels are left out."""
        labels = {
            "run": self._run,
            "role": self._metrics.labels["role"],
            "instance": self._metrics.labels["instance"],
        }
        return {name: value for name, value in labels.items() if value}

    def start(self) -> MetricsPusher:
        self._thread.start()
        return self

    def close(self, *, delete: bool) -> None:
        """Stop pushing; then delete the node's group (``delete``: a clean exit) or push a last
        time (it stopped for a reason an operator should see). Returns within about two push
        timeouts even when the gateway hangs (the thread is a daemon: it never holds the exit)."""
        if not self._thread.is_alive():
            return
        self._delete = delete
        self._stop.set()
        self._thread.join(timeout=2 * self.timeout_s + 1.0)
        if self._thread.is_alive():
            log.warning("metrics_push_close_timed_out", gateway=self.url, timeout_s=self.timeout_s)

    def push_once(self) -> bool:
        """One push now (the thread's work; tests call it too); True if the gateway took it."""
        return self._attempt("push", self._push)

    def _push(self) -> None:
        push_to_gateway(
            self.url,
            job=self.job,
            registry=self._metrics.registry,
            grouping_key=self.grouping_key,
            timeout=self.timeout_s,
        )

    def _remove(self) -> None:
        delete_from_gateway(self.url, job=self.job, grouping_key=self.grouping_key, timeout=self.timeout_s)

    def _run_pushes(self) -> None:
        self.push_once()
        while not self._stop.wait(self.interval_s):
            self.push_once()
        if self._delete:
            if self._attempt("delete", self._remove):
                log.info("metrics_group_deleted", gateway=self.url, **self.grouping_key)
        else:
            self.push_once()

    def _attempt(self, what: str, action: Callable[[], None]) -> bool:
        try:
            action()
        except Exception as exc:  # any failure of a best-effort push: urllib's, the gateway's
            self._pushes.labels(outcome="failed").inc()
            if not self._failing:
                log.warning(
                    "metrics_push_failed", gateway=self.url, action=what, error=str(exc) or type(exc).__name__
                )
            self._failing = True
            return False
        self._pushes.labels(outcome="ok").inc()
        if self._failing:
            log.info("metrics_push_recovered", gateway=self.url)
        self._failing = False
        return True
