"""How one node's metrics leave it: a ``/metrics`` endpoint to scrape, pushes to a gateway,
both, or neither, as its :class:`NodeSettings` say.

Every role's command (``agora dht serve``, ``agora-worker run``, ``agora-trainer run``,
``agora-authorizer serve``, the monitor) starts one after its node is built and closes it on the
way out, saying whether the exit was clean: a clean exit deletes the node's group from the
gateway, any other leaves its last values there for the alerts (``agora_core.observability.metrics_push``).
"""

from __future__ import annotations

from agora_core.config import NodeSettings
from agora_core.observability.metrics import MetricsEndpoint, NodeMetrics
from agora_core.observability.metrics_push import MetricsPusher


class MetricsExposure:
    def __init__(self, *, endpoint: MetricsEndpoint | None, pusher: MetricsPusher | None, host: str):
        self.endpoint, self.pusher, self._host = endpoint, pusher, host

    @classmethod
    def start(cls, metrics: NodeMetrics, settings: NodeSettings, *, run: str) -> MetricsExposure:
        """Serve on ``settings.metrics_host:metrics_port`` (when a port is set) and push to
        ``settings.metrics_push_gateway`` (when set) the metrics of run ``run``'s node."""
        endpoint = None
        if settings.metrics_port is not None:
            endpoint = metrics.serve_http(settings.metrics_port, host=settings.metrics_host)
        pusher = None
        if settings.metrics_push_gateway:
            pusher = MetricsPusher(
                metrics, settings.metrics_push_gateway, run=run, interval_s=settings.metrics_push_interval_s
            ).start()
        return cls(endpoint=endpoint, pusher=pusher, host=settings.metrics_host)

    @property
    def url(self) -> str | None:
        """Where ``/metrics`` is served (None: not served)."""
        if self.endpoint is None:
            return None
        host = f"[{self._host}]" if ":" in self._host else self._host  # an IPv6 literal
        return f"http://{host}:{self.endpoint.port}/metrics"

    def describe(self) -> list[str]:
        """The lines a command prints about where its metrics go."""
        lines = []
        if self.url is not None:
            lines.append(f"  metrics    {self.url}")
        if self.pusher is not None:
            lines.append(f"  pushing    metrics to {self.pusher.url} every {self.pusher.interval_s:g} s")
        return lines

    def close(self, *, clean: bool) -> None:
        """Stop serving and pushing; ``clean``: the node stopped as asked (its gateway group is
        deleted), else it keeps its last values on the gateway."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.pusher is not None:
            self.pusher.close(delete=clean)
            self.pusher = None
