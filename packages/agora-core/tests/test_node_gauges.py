"""The gauges every node exports about itself: its resident memory, and (holding one) when its
credential expires."""

from __future__ import annotations

import time

from agora_core.config import RunConfig
from agora_core.identity import NodeKey
from agora_core.node.host import host_rss_bytes
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_devkit.authority import TestAuthority

EXPIRY = "agora_credential_expiry_timestamp_seconds"
REMAINING = "agora_credential_remaining_seconds"


def test_every_node_exports_its_resident_memory_read_when_collected():
    metrics = NodeMetrics(role="trainer", instance="t1")
    before = metrics.sample_value("agora_host_rss_bytes")
    assert before > 1 << 20 and abs(before - host_rss_bytes()) < 64 << 20
    ballast = bytearray(256 << 20)  # touched pages: resident
    try:
        assert metrics.sample_value("agora_host_rss_bytes") > before + (200 << 20)
    finally:
        del ballast


def test_a_credentialed_node_exports_when_its_credential_expires_and_follows_refreshes():
    authority = TestAuthority()
    key = NodeKey.generate()
    metrics = NodeMetrics(role="dht", instance=key.node_id[:12])
    first = authority.credential(key, role="dht", stage=None, lifetime_s=600.0)
    node = RunNode(run=authority.run_config(), key=key, metrics=metrics, credential=first)
    assert metrics.sample_value(EXPIRY) == first.credential.expires
    assert 590.0 < metrics.sample_value(REMAINING) <= 600.0
    refreshed = authority.credential(key, role="dht", stage=None, lifetime_s=1200.0)
    node.set_credential(refreshed)
    assert metrics.sample_value(EXPIRY) == refreshed.credential.expires
    assert metrics.sample_value(REMAINING) > 1190.0
    assert metrics.sample_value(EXPIRY) > time.time() + 1190.0


def test_a_node_without_a_credential_exports_no_expiry():
    metrics = NodeMetrics(role="worker")
    RunNode(run=RunConfig(), key=NodeKey.generate(), metrics=metrics)  # an open run's node
    assert metrics.sample_value(EXPIRY) is None and metrics.sample_value(REMAINING) is None
    assert EXPIRY not in metrics.exposition().decode()
