"""An RPC server's metrics: requests by method and outcome, their time, what was rejected."""

from __future__ import annotations

from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.types import Traffic


class ServerMetrics:
    def __init__(self, metrics: NodeMetrics, traffic: Traffic):
        # per request, counted as plain numbers: a Counter.inc() and a Histogram.observe() per
        # small call cost more than answering it
        self._requests: dict[tuple[str, str], int] = {}
        metrics.counter_from(
            "agora_rpc_requests_total",
            "Requests handled, by method and outcome.",
            ["method", "outcome"],
            lambda: dict(self._requests),
        )
        self._rejected = metrics.counter(
            "agora_rpc_rejected_messages_total",
            "Incoming messages rejected or dropped before reaching a handler, by reason.",
            ["reason"],
        )
        self._seconds = metrics.histogram_from(
            "agora_rpc_handler_seconds", "Time from request arrival to reply, by method.", ["method"]
        )
        self.inflight = metrics.gauge("agora_rpc_inflight_requests", "Requests being handled.")
        metrics.counter_from(
            "agora_rpc_server_bytes_total",
            "Bytes through the server socket.",
            ["direction"],
            traffic.bytes_by_direction,
        )

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def handled(self, method: str, outcome: str, seconds: float) -> None:
        key = (method, outcome)
        self._requests[key] = self._requests.get(key, 0) + 1
        self._seconds.observe((method,), seconds)
