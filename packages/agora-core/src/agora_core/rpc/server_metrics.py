"""An RPC server's metrics: requests by method and outcome, their time, what was rejected."""

from __future__ import annotations

from agora_core.metrics import NodeMetrics
from agora_core.rpc.types import Traffic


class ServerMetrics:
    def __init__(self, metrics: NodeMetrics, traffic: Traffic):
        self._requests = metrics.counter(
            "agora_rpc_requests_total", "Requests handled, by method and outcome.", ["method", "outcome"]
        )
        self._rejected = metrics.counter(
            "agora_rpc_rejected_messages_total",
            "Incoming messages rejected or dropped before reaching a handler, by reason.",
            ["reason"],
        )
        self._seconds = metrics.histogram(
            "agora_rpc_handler_seconds", "Time from request arrival to reply, by method.", ["method"]
        )
        self.inflight = metrics.gauge("agora_rpc_inflight_requests", "Requests being handled.")
        self._children: dict[tuple[str, str], tuple] = {}
        metrics.counter_from(
            "agora_rpc_server_bytes_total",
            "Bytes through the server socket.",
            ["direction"],
            traffic.bytes_by_direction,
        )

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def handled(self, method: str, outcome: str, seconds: float) -> None:
        children = self._children.get((method, outcome))
        if children is None:  # labels() is slow; bind each (method, outcome) once
            children = self._children[(method, outcome)] = (
                self._requests.labels(method=method, outcome=outcome),
                self._seconds.labels(method=method),
            )
        children[0].inc()
        children[1].observe(seconds)
