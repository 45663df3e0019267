"""Self-termination rules without a network: windows, runs, clocks, and the watchdog's verdict."""

from __future__ import annotations

import dataclasses
import resource

import pytest

from agora_core.config import TerminationConfig
from agora_core.contract import DepartureReason
from agora_core.identity import NodeKey
from agora_core.node.host import host_rss_bytes
from agora_core.observability.metrics import NodeMetrics
from agora_worker.averaging.averager import RoundReport
from agora_worker.termination import EXIT_CODES, Watchdog, round_failed
from agora_worker.termination.rules import (
    AveragingFailures,
    HostMemory,
    InARow,
    NoProgress,
    Unreachable,
)
from agora_worker.termination.watchdog import rules_for

MiB = 1 << 20


def report(index: int, *, success: float = 1.0, group: int = 3, reducers: int = 3, **changes) -> RoundReport:
    return RoundReport(
        round=index,
        segment=index % 4,
        group_size=group,
        reduce_success=1.0,
        averaging_success=success,
        seconds=1.0,
        bytes_moved=1000,
        reducers=reducers,
        **changes,
    )


OK, FAIL = 1.0, 0.0


def window(outcomes: list[float]) -> AveragingFailures:
    reports = [report(i, success=s) for i, s in enumerate(outcomes)]
    return AveragingFailures(reports=lambda: reports, failed=2, window=3)


def test_two_failures_within_three_rounds_trip_even_with_a_success_between():
    verdict = window([FAIL, OK, FAIL]).check(0.0)
    assert verdict is not None and verdict.reason is DepartureReason.AVERAGING_FAILURES
    assert (verdict.value, verdict.threshold, verdict.unit) == (2.0, 2.0, "rounds")
    assert "rounds 0, 2" in verdict.detail


def test_two_failures_three_rounds_apart_do_not_trip():
    assert window([FAIL, OK, OK, FAIL]).check(0.0) is None
    assert window([FAIL, OK, OK, FAIL, OK, OK, FAIL]).check(0.0) is None


def test_the_window_slides_over_rounds_as_they_arrive():
    reports: list[RoundReport] = []
    rule = AveragingFailures(reports=lambda: reports, failed=2, window=3)
    for index, outcome in enumerate([FAIL, OK, OK]):
        reports.append(report(index, success=outcome))
        assert rule.check(0.0) is None
    reports.append(report(3, success=FAIL))
    assert rule.check(0.0) is None and rule.value == 1  # round 0 left the window
    reports.append(report(4, success=FAIL))
    assert rule.check(0.0) is not None


def test_which_rounds_count_as_failed():
    assert round_failed(report(0, success=0.0)) is True  # peers, a reducer, nothing came back
    assert round_failed(report(0, success=0.0, excluded=True)) is True  # came late
    assert round_failed(report(0, success=0.0, group=1, matchmaking_failed=True)) is True
    assert round_failed(report(0, success=0.5)) is False  # a reducer's slice lost: not this worker's
    assert round_failed(report(0, success=0.0, group=1, reducers=1)) is None  # alone: nobody to average with
    assert round_failed(report(0, success=0.0, reducers=0)) is None  # no reducer in the group
    # rounds that do not count neither trip nor break a run of failures
    reports = [report(0, success=FAIL), report(1, group=1, success=0.0), report(2, success=FAIL)]
    assert AveragingFailures(reports=lambda: reports, failed=2, window=2).check(0.0) is not None


def test_failures_in_a_row_trip_at_the_threshold():
    count = [0]
    rule = InARow(
        DepartureReason.DEVICE_FAILURE, lambda: count[0], 3, unit="requests", what="requests failed"
    )
    count[0] = 2
    assert rule.check(0.0) is None
    count[0] = 3
    verdict = rule.check(0.0)
    assert verdict is not None and verdict.exit_code == EXIT_CODES[DepartureReason.DEVICE_FAILURE]
    assert verdict.detail == "3 requests failed in a row (limit 3)"


def test_unreachable_counts_from_the_last_peer_or_the_last_successful_dht_operation():
    peers, last_ok = [1], [0.0]
    rule = Unreachable(peers=lambda: peers[0], last_ok=lambda: last_ok[0], threshold_s=10.0)
    assert rule.check(0.0) is None
    peers[0] = 0  # alone from t = 0 on; the DHT (itself only) still answers
    last_ok[0] = 11.0
    assert rule.check(9.0) is None
    verdict = rule.check(11.0)
    assert verdict is not None and "no other DHT member alive for 11.0 s" in verdict.detail
    peers[0] = 2  # peers back, but nothing it writes gets through
    assert rule.check(12.0) is None
    verdict = rule.check(21.5)
    assert verdict is not None and "no DHT operation succeeded for 10.5 s" in verdict.detail


def test_the_first_node_of_a_dht_that_nobody_joined_yet_lost_no_connectivity():
    rule = Unreachable(peers=lambda: 0, last_ok=lambda: 100.0, threshold_s=10.0)  # its own DHT answers
    assert rule.check(0.0) is None and rule.check(100.0) is None


def test_no_progress_trips_only_while_samples_wait_for_a_step_that_does_not_come():
    step, pending = [4], [0]
    rule = NoProgress(step=lambda: step[0], pending=lambda: pending[0], threshold_s=5.0)
    assert rule.check(0.0) is None
    assert rule.check(100.0) is None  # idle: nothing waits for a step
    pending[0] = 3
    assert rule.check(101.0) is None
    step[0] = 5  # the stage stepped: the clock restarts
    assert rule.check(105.0) is None
    assert rule.check(109.0) is None
    verdict = rule.check(110.0)
    assert verdict is not None and verdict.value == 5.0 and "at step 5" in verdict.detail


def test_host_memory_is_read_from_the_process_and_compared_in_mib():
    rss = host_rss_bytes()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert 10 * MiB < rss <= peak + 64 * MiB  # torch is loaded: tens of MiB at least; never above the peak
    rule = HostMemory(limit_mib=512, rss_bytes=lambda: 600 * MiB)
    verdict = rule.check(0.0)
    assert verdict is not None and (verdict.value, verdict.unit) == (600.0, "MiB")
    assert HostMemory(limit_mib=512, rss_bytes=lambda: 100 * MiB).check(0.0) is None


def test_every_reason_exits_with_its_own_code_outside_the_shells_range():
    codes = list(EXIT_CODES.values())
    assert sorted(EXIT_CODES) == sorted(DepartureReason) and len(set(codes)) == len(codes)
    assert all(2 < code < 126 for code in codes)


def test_a_zero_threshold_switches_its_rule_off():
    off = TerminationConfig(
        compute_failures=0,
        nonfinite_steps=0,
        unreachable_s=0,
        no_progress_s=0,
        max_host_rss_mib=0,
        failed_rounds=0,
    )
    assert rules_for(off, worker=None) == []  # nothing is read from the worker either
    on = dataclasses.replace(off, max_host_rss_mib=1, failed_rounds=2)
    assert [r.reason for r in rules_for(on, worker=None)] == ["host_memory", "averaging_failures"]
    with pytest.raises(ValueError, match="positive threshold"):
        HostMemory(limit_mib=0)


def test_the_watchdog_exports_every_rule_and_returns_the_first_that_tripped():
    metrics = NodeMetrics(role="worker", stage=1)
    count = [0]
    rules = [
        HostMemory(limit_mib=1 << 30, rss_bytes=lambda: 5 * MiB),
        InARow(DepartureReason.NONFINITE_GRADIENTS, lambda: count[0], 1, unit="steps", what="bad steps"),
        InARow(DepartureReason.DEVICE_FAILURE, lambda: count[0], 1, unit="requests", what="failures"),
    ]
    watchdog = Watchdog(
        rules=rules,
        interval_s=1.0,
        dht=None,  # check() only evaluates: nothing departs, nothing is written
        key=NodeKey.generate(),
        run_name="r",
        stage=1,
        step=lambda: 0,
        retire=None,
        departure_ttl_s=60.0,
        timeout_s=1.0,
        metrics=metrics,
    )
    assert watchdog.check(0.0) is None and watchdog.exit_code == 0
    assert metrics.sample_value("agora_worker_termination_value", {"rule": "host_memory"}) == 5.0
    count[0] = 1
    verdict = watchdog.check(1.0)
    assert verdict is not None and verdict.reason is DepartureReason.NONFINITE_GRADIENTS
    assert metrics.sample_value("agora_worker_termination_value", {"rule": "device_failure"}) == 1.0
