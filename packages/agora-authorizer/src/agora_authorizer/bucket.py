"""The token bucket that paces admissions: ``rate_per_minute`` on average, ``burst`` at once.

Admitting many nodes at once makes the DHT reorganize and the stages' averaging groups churn
together (the report's reason for queueing), so the authorizer releases the queue through
this bucket. A rate of 0 switches pacing off.
"""

from __future__ import annotations

from collections.abc import Callable

from agora_core import world


class TokenBucket:
    def __init__(
        self, rate_per_minute: float, burst: int, clock: Callable[[], float] = lambda: world.monotonic()
    ):
        self.rate_per_s = rate_per_minute / 60.0
        self.burst = burst
        self.clock = clock
        self._tokens = float(burst)
        self._at = clock()

    @property
    def unlimited(self) -> bool:
        return self.rate_per_s <= 0

    def _fill(self) -> None:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate_per_s)
        self._at = now

    def tokens(self) -> float:
        if self.unlimited:
            return float("inf")
        self._fill()
        return self._tokens

    def take(self) -> bool:
        """Spend one token if there is one."""
        if self.unlimited:
            return True
        self._fill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_s(self, tokens: float = 1.0) -> float:
        """Seconds until ``tokens`` tokens are there (from now, at the current rate)."""
        if self.unlimited:
            return 0.0
        self._fill()
        return max(0.0, (tokens - self._tokens) / self.rate_per_s)
