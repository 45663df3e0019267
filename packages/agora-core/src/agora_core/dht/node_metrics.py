"""A DHT node's metrics: membership as it sees it, records held, operations and their latency."""

from __future__ import annotations

import collections
import time

from agora_core.dht.membership import MemberTable
from agora_core.observability.metrics import NodeMetrics

OP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class DhtMetrics:
    def __init__(self, m: NodeMetrics):
        self.members = m.gauge("agora_dht_members", "Members in this node's view.", ["status"])
        self.records = m.gauge("agora_dht_records", "Records this node holds as a replica.")
        self.ops = m.counter("agora_dht_ops_total", "DHT operations, by kind and outcome.", ["op", "outcome"])
        self.op_seconds = m.histogram(
            "agora_dht_op_seconds", "DHT operation latency.", ["op"], buckets=OP_BUCKETS
        )
        self.suspicions = m.gauge("agora_dht_suspicions", "Members this node saw become suspect.")
        self.refutations = m.gauge("agora_dht_refutations", "Suspicions of this node it refuted.")
        self.deaths = m.gauge("agora_dht_deaths", "Members this node saw declared dead.")
        self.claims_rejected = m.counter(
            "agora_dht_claims_rejected_total", "Membership claims refused, by reason.", ["reason"]
        )
        self.dropped = m.gauge(
            "agora_dht_members_dropped", "Members dropped for an expired or revoked credential."
        )
        self.recent_ops: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)
        self.ops_done = 0
        # (op, outcome) -> its counter and histogram children, each looked up once: .labels()
        # takes a lock and walks the label values on every call, and every get and store counts
        self._children: dict[tuple[str, str], tuple] = {}

    def rejected(self, reason: str) -> None:
        self.claims_rejected.labels(reason=reason).inc()

    def observe(self, op: str, outcome: str, started: float) -> None:
        seconds = time.perf_counter() - started
        children = self._children.get((op, outcome))
        if children is None:
            children = self._children[op, outcome] = (
                self.ops.labels(op=op, outcome=outcome),
                self.op_seconds.labels(op=op),
            )
        children[0].inc()
        children[1].observe(seconds)
        self.recent_ops.append((op, seconds))
        self.ops_done += 1

    def update(self, table: MemberTable, records: int) -> None:
        suspect = len(table.suspects())
        self.members.labels(status="alive").set(table.live_count() - suspect)
        self.members.labels(status="suspect").set(suspect)
        self.records.set(records)
        self.suspicions.set(table.suspicions)
        self.refutations.set(table.refutations)
        self.deaths.set(table.deaths)
        self.dropped.set(table.dropped)
