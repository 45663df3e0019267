"""Self-termination rules: each a small object that measures one signal against its threshold.

A rule reads a signal the worker already keeps (through a callable, so it holds no reference to
the worker), turns it into one number in its unit, and trips when that number reaches the
threshold of the run config's ``[termination]`` section. Rules whose threshold is 0 are off and
never built. Each reason exits the process with its own code (``EXIT_CODES``).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agora_core.admission.node_admission import CREDENTIAL_LOST_EXIT_CODE
from agora_core.contract import DepartureReason
from agora_core.node.host import host_rss_bytes
from agora_worker.averaging.averager import RoundReport

MiB = 1 << 20

# The process exit code of each reason. 0 is a clean stop, 1 an error, 2 a usage error (click);
# these stay clear of the shell's 126-165 (not executable, not found, killed by a signal).
EXIT_CODES: dict[DepartureReason, int] = {
    DepartureReason.DEVICE_FAILURE: 10,
    DepartureReason.NONFINITE_GRADIENTS: 11,
    DepartureReason.UNREACHABLE: 12,
    DepartureReason.NO_PROGRESS: 13,
    DepartureReason.HOST_MEMORY: 14,
    DepartureReason.AVERAGING_FAILURES: 15,
    DepartureReason.CREDENTIAL_LOST: CREDENTIAL_LOST_EXIT_CODE,  # 16; a trainer exits with it too
}
if set(EXIT_CODES) != set(DepartureReason) or len(set(EXIT_CODES.values())) != len(EXIT_CODES):
    raise RuntimeError("every departure reason needs an exit code of its own")


@dataclass(frozen=True)
class Verdict:
    """A rule that tripped: why, what it measured and the threshold it reached."""

    reason: DepartureReason
    value: float
    threshold: float
    unit: str
    detail: str

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.reason]


class Rule:
    """Measures one signal (``measure``) and trips when it reaches ``threshold``."""

    reason: DepartureReason
    unit: str

    def __init__(self, threshold: float):
        if threshold <= 0:
            raise ValueError(f"a {self.reason} rule needs a positive threshold, got {threshold}")
        self.threshold = float(threshold)
        self.value = 0.0  # the last measurement (exported as a gauge)

    def measure(self, now: float) -> float:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, now: float) -> Verdict | None:
        """Measure at ``now`` (world.monotonic()); a verdict when the threshold is reached."""
        self.value = float(self.measure(now))
        if self.value < self.threshold:
            return None
        return Verdict(self.reason, self.value, self.threshold, self.unit, self.describe())


class InARow(Rule):
    """A counter of failures in a row that the worker resets on success."""

    def __init__(
        self, reason: DepartureReason, count: Callable[[], int], threshold: int, *, unit: str, what: str
    ):
        self.reason, self.unit, self._count, self._what = reason, unit, count, what
        super().__init__(threshold)

    def measure(self, now: float) -> float:
        return self._count()

    def describe(self) -> str:
        return f"{self.value:g} {self._what} in a row (limit {self.threshold:g})"


class Unreachable(Rule):
    """Seconds since the worker last had another live DHT member *and* a DHT operation succeed.

    ``peers()`` counts the other live members in its view; ``last_ok()`` is when its last
    announcement or progress exchange succeeded (world.monotonic()). A worker that never had a
    peer (the first node of a new DHT, waiting for others) lost nothing and is not counted
    alone; a worker given bootstrap addresses had its peers at join.
    """

    reason, unit = DepartureReason.UNREACHABLE, "s"

    def __init__(self, *, peers: Callable[[], int], last_ok: Callable[[], float], threshold_s: float):
        super().__init__(threshold_s)
        self._peers, self._last_ok = peers, last_ok
        self._peer_at: float | None = None  # when another member was last seen alive
        self._alone_s = self._failing_s = 0.0

    def measure(self, now: float) -> float:
        if self._peers() > 0:
            self._peer_at = now
        self._alone_s = 0.0 if self._peer_at is None else now - self._peer_at
        self._failing_s = max(0.0, now - self._last_ok())
        return max(self._alone_s, self._failing_s)

    def describe(self) -> str:
        if self._alone_s >= self._failing_s:
            return f"no other DHT member alive for {self._alone_s:.1f} s (limit {self.threshold:g} s)"
        return f"no DHT operation succeeded for {self._failing_s:.1f} s (limit {self.threshold:g} s)"


class NoProgress(Rule):
    """Seconds this worker has held samples toward a step while its stage's step stayed put.

    ``step()`` is the stage's furthest step as last read from the DHT; ``pending()`` the samples
    this worker accumulated toward its next step. A worker holding none is idle, not stalled.
    """

    reason, unit = DepartureReason.NO_PROGRESS, "s"

    def __init__(self, *, step: Callable[[], int], pending: Callable[[], int], threshold_s: float):
        super().__init__(threshold_s)
        self._step, self._pending = step, pending
        self._seen: int | None = None
        self._since = 0.0

    def measure(self, now: float) -> float:
        step = self._step()
        if step != self._seen or self._pending() == 0:
            self._seen, self._since = step, now
        return now - self._since

    def describe(self) -> str:
        return (
            f"held samples for {self.value:.1f} s while the stage stayed at step {self._seen}"
            f" (limit {self.threshold:g} s)"
        )


class HostMemory(Rule):
    """The process's resident memory, MiB, against the limit."""

    reason, unit = DepartureReason.HOST_MEMORY, "MiB"

    def __init__(self, *, limit_mib: int, rss_bytes: Callable[[], int] = host_rss_bytes):
        super().__init__(limit_mib)
        self._rss_bytes = rss_bytes

    def measure(self, now: float) -> float:
        return round(self._rss_bytes() / MiB, 1)

    def describe(self) -> str:
        return f"resident memory {self.value:g} MiB reached the limit of {self.threshold:g} MiB"


class CredentialLost(Rule):
    """The worker's credential is gone: a refresh was refused (its node or account banned),
    it expired with no refresh getting through, or its node id is on the run's revocation
    list. ``lost()`` is ``(reason, detail)`` once that happened, else None; never in an open run.
    """

    reason, unit = DepartureReason.CREDENTIAL_LOST, "credentials"

    def __init__(self, *, lost: Callable[[], tuple[str, str] | None]):
        super().__init__(1)
        self._lost = lost

    def measure(self, now: float) -> float:
        return 0.0 if self._lost() is None else 1.0

    def describe(self) -> str:
        reason, detail = self._lost() or ("", "")
        return f"the credential was lost ({reason}): {detail}; it may rejoin through admission"


def round_failed(report: RoundReport) -> bool | None:
    """Whether an averaging round failed for this worker; None when it does not count.

    Failed: no group could be formed, or the worker had peers and a reducer to average with and
    none of its segment's average came back (it came late and the reducers refused its group,
    they banned it for missing chunk deadlines, or none of them could be reached). Not counted:
    rounds it was alone in or whose group had no reducer (nobody to average with, nobody to drift
    from; not this worker's failure). A round where part of the segment came back succeeded: a
    slice that did not is its reducer's failure, and the worker still averaged the rest.
    """
    if report.matchmaking_failed:
        return True
    if report.group_size < 2 or report.reducers == 0:
        return None
    return report.averaging_success == 0.0


class AveragingFailures(Rule):
    """Failed rounds among the last ``window`` counted rounds (report: 2 of the last 3)."""

    reason, unit = DepartureReason.AVERAGING_FAILURES, "rounds"

    def __init__(self, *, reports: Callable[[], Sequence[RoundReport]], failed: int, window: int):
        super().__init__(failed)
        self._reports = reports
        self._read = 0  # reports already classified
        self._recent: collections.deque[tuple[int, bool]] = collections.deque(maxlen=window)

    def measure(self, now: float) -> float:
        reports = self._reports()
        for report in reports[self._read :]:
            failed = round_failed(report)
            if failed is not None:
                self._recent.append((report.round, failed))
        self._read = len(reports)
        return sum(failed for _, failed in self._recent)

    def describe(self) -> str:
        rounds = [index for index, failed in self._recent if failed]
        return (
            f"{self.value:g} of the last {len(self._recent)} averaging rounds failed"
            f" (rounds {', '.join(map(str, rounds))}; limit {self.threshold:g})"
        )
