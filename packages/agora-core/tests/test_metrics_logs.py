"""Per-node metrics (labels, HTTP exposition) and structured logging; pushes: test_metrics_push.py."""

from __future__ import annotations

import io
import json
import urllib.request

import pytest

from agora_core.observability.logs import configure_logging, get_logger
from agora_core.observability.metrics import NodeMetrics


def test_every_sample_carries_the_node_labels():
    metrics = NodeMetrics(role="worker", stage=2, instance="w1")
    metrics.counter("agora_test_events_total", "Events.", ["kind"]).labels(kind="a").inc(3)
    metrics.gauge("agora_test_level", "Level.").set(1.5)
    assert metrics.sample_value("agora_test_events_total", {"kind": "a"}) == 3
    text = metrics.exposition().decode()
    for line in text.splitlines():
        if line.startswith("agora_test_"):
            assert 'role="worker"' in line and 'stage="2"' in line and 'instance="w1"' in line


def test_two_nodes_in_one_process_keep_separate_metrics():
    a, b = NodeMetrics(role="worker", instance="a"), NodeMetrics(role="worker", instance="b")
    a.counter("agora_test_calls_total", "Calls.").inc()
    b.counter("agora_test_calls_total", "Calls.").inc(5)
    assert a.sample_value("agora_test_calls_total") == 1
    assert b.sample_value("agora_test_calls_total") == 5


def test_declaring_twice_returns_the_same_metric_and_conflicts_are_refused():
    metrics = NodeMetrics(role="x")
    first = metrics.counter("agora_test_things_total", "Things.", ["k"])
    assert metrics.counter("agora_test_things_total", "Things.", ["k"]) is first
    with pytest.raises(ValueError, match="already declared"):
        metrics.gauge("agora_test_things_total", "Things.")
    with pytest.raises(ValueError, match="agora_ prefix"):
        metrics.counter("things_total", "Things.")
    with pytest.raises(ValueError, match="added per node"):
        metrics.counter("agora_test_other_total", "Other.", ["stage"])


def test_a_counter_read_at_collection_time_sums_its_sources():
    metrics = NodeMetrics(role="worker", instance="w1")
    first, second = {"sent": 0}, {"sent": 0}
    for totals in (first, second):  # e.g. two sockets of one node, each counting in plain ints
        metrics.counter_from(
            "agora_test_bytes_total", "Bytes.", ["direction"], lambda t=totals: {("sent",): t["sent"]}
        )
    first["sent"], second["sent"] = 100, 23
    assert metrics.sample_value("agora_test_bytes_total", {"direction": "sent"}) == 123
    second["sent"] = 30  # read afresh at every collection, never cached
    text = metrics.exposition().decode()
    assert 'agora_test_bytes_total{direction="sent",instance="w1",role="worker",stage=""} 130.0' in text
    with pytest.raises(ValueError, match="already declared"):
        metrics.counter("agora_test_bytes_total", "Bytes.", ["direction"])


def test_metrics_are_served_over_http():
    metrics = NodeMetrics(role="trainer", instance="t1")
    metrics.counter("agora_test_scraped_total", "Scraped.").inc(2)
    endpoint = metrics.serve_http(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert 'agora_test_scraped_total{instance="t1",role="trainer",stage=""} 2.0' in body
    finally:
        endpoint.close()


def test_json_logs_are_one_object_per_line():
    stream = io.StringIO()
    configure_logging(fmt="json", level="info", stream=stream)
    try:
        log = get_logger("test.component", node="n1")
        log.info("thing_happened", count=3)
        log.debug("hidden_at_info_level")
        lines = stream.getvalue().strip().splitlines()
        assert len(lines) == 1
        record = json.loads(lines[0])
        assert record["event"] == "thing_happened" and record["count"] == 3
        assert record["component"] == "test.component" and record["node"] == "n1"
        assert record["level"] == "info" and "timestamp" in record
    finally:
        configure_logging(fmt="console", level="warning", stream=io.StringIO())


def test_console_logs_for_humans_and_bad_settings_refused():
    stream = io.StringIO()
    configure_logging(fmt="console", level="debug", stream=stream)
    get_logger("test").debug("visible", x=1)
    assert "visible" in stream.getvalue() and "x=1" in stream.getvalue()
    with pytest.raises(ValueError):
        configure_logging(fmt="xml")
    with pytest.raises(ValueError):
        configure_logging(level="chatty")
