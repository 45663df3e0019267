"""Periodic pushes to a real push gateway process: grouping, deletion on a clean exit, and a
gateway that goes away or hangs costing the node nothing but counted failures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from agora_core.config import NodeSettings
from agora_core.errors import ConfigError
from agora_core.observability.metrics import NodeMetrics
from agora_core.observability.metrics_push import MetricsPusher
from agora_devkit.processes import wait_until
from agora_devkit.prometheus import pushgateway_process

INTERVAL_S = 0.05
WAIT_S = 10.0


def node(instance: str) -> tuple[NodeMetrics, object]:
    metrics = NodeMetrics(role="worker", stage=1, instance=instance)
    return metrics, metrics.counter("agora_test_events_total", "Events.")


def pushed(gateway, instance: str) -> float | None:
    group = gateway.group(instance=instance)
    return None if group is None else group.value("agora_test_events_total")


def test_pushes_repeat_grouped_by_run_role_instance_and_a_clean_close_deletes_the_group(gateway):
    metrics, events = node("push-clean")
    pusher = MetricsPusher(metrics, gateway.address, run="run-a", interval_s=INTERVAL_S).start()
    try:
        events.inc()
        wait_until(lambda: pushed(gateway, "push-clean") == 1, timeout_s=WAIT_S, what="the first value")
        events.inc(4)  # only a later push can carry this
        wait_until(lambda: pushed(gateway, "push-clean") == 5, timeout_s=WAIT_S, what="a later push")
        group = gateway.group(instance="push-clean")
        assert group.labels == {"job": "agora", "run": "run-a", "role": "worker", "instance": "push-clean"}
        assert group.value("agora_test_events_total", stage="1") == 5  # the stage rides on samples
        assert group.value("agora_host_rss_bytes") > 1 << 20
        assert group.value("agora_metrics_pushes_total", outcome="ok") >= 1
    finally:
        pusher.close(delete=True)
    assert gateway.group(instance="push-clean") is None


def test_a_close_that_is_not_clean_pushes_once_more_and_keeps_the_group(gateway):
    metrics, events = node("push-kept")
    pusher = MetricsPusher(metrics, gateway.address, run="run-a", interval_s=60.0).start()
    try:
        wait_until(lambda: pushed(gateway, "push-kept") == 0, timeout_s=WAIT_S, what="the first push")
        events.inc(7)  # the next interval is a minute away: only the last push carries it
    finally:
        pusher.close(delete=False)
    assert pushed(gateway, "push-kept") == 7


def test_a_gateway_that_goes_away_costs_counted_failures_and_no_stall():
    metrics, _ = node("push-gone")
    with pushgateway_process() as short_lived:
        pusher = MetricsPusher(metrics, short_lived.address, run="run-a", interval_s=INTERVAL_S).start()
        wait_until(lambda: pushed(short_lived, "push-gone") == 0, timeout_s=WAIT_S, what="the first push")
    try:  # the gateway process is stopped now
        failed = lambda: metrics.sample_value("agora_metrics_pushes_total", {"outcome": "failed"}) or 0  # noqa: E731
        wait_until(lambda: failed() >= 2, timeout_s=WAIT_S, what="failed pushes counted")
    finally:
        started = time.monotonic()
        pusher.close(delete=True)  # its delete fails too: logged, not raised
    assert time.monotonic() - started < pusher.timeout_s + 1.0


def test_a_gateway_that_never_answers_costs_one_timeout_per_push():
    # A socket that accepts connections (the kernel does, from its backlog) and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        metrics, _ = node("push-hung")
        pusher = MetricsPusher(metrics, address, run="run-a", interval_s=INTERVAL_S, timeout_s=0.2).start()
        failed = lambda: metrics.sample_value("agora_metrics_pushes_total", {"outcome": "failed"}) or 0  # noqa: E731
        try:
            wait_until(lambda: failed() >= 2, timeout_s=WAIT_S, what="timed-out pushes counted")
        finally:
            started = time.monotonic()
            pusher.close(delete=True)
        assert time.monotonic() - started < 2 * 0.2 + 1.0
        assert not pusher._thread.is_alive()


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("http://:9091", "expected host:port"),
        ("gateway.example", "expected host:port"),
        ("127.0.0.1:99999", "port must be a number"),
        ("ftp://127.0.0.1:9091", "http or https"),
    ],
)
def test_a_bad_gateway_address_is_refused_naming_the_setting(address, says):
    with pytest.raises(ConfigError, match=f"metrics_push_gateway: .*{says}"):
        NodeSettings.resolve(environ={"AGORA_METRICS_PUSH_GATEWAY": address})


def test_a_node_given_a_bad_gateway_exits_at_startup_with_the_reason(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "agora_core", "dht", "serve", "--key-file", str(tmp_path / "k")],
        env={**os.environ, "AGORA_METRICS_PUSH_GATEWAY": "localhost"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: metrics_push_gateway: 'localhost': expected host:port"), (
        result.stderr
    )


def test_good_gateway_addresses_and_the_interval_knob():
    settings = NodeSettings.resolve(
        environ={
            "AGORA_METRICS_PUSH_GATEWAY": "http://127.0.0.1:9091/",
            "AGORA_METRICS_PUSH_INTERVAL_S": "2.5",
        }
    )
    assert settings.metrics_push_interval_s == 2.5
    assert MetricsPusher(NodeMetrics(role="x"), settings.metrics_push_gateway, run="r", interval_s=1).url == (
        "http://127.0.0.1:9091"
    )
    with pytest.raises(ConfigError, match="metrics_push_interval_s"):
        NodeSettings.resolve(environ={"AGORA_METRICS_PUSH_INTERVAL_S": "0"})
