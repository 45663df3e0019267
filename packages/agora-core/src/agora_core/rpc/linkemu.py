"""In-process emulation of a node's internet access link (no netem needed).

A node started with a :class:`LinkConfig` delays every message it sends through an upload
link and every message it receives through a download link. Each direction is a FIFO pipe:
a message occupies the pipe for ``size / rate`` seconds after the previous one leaves it, then
arrives ``latency ± jitter`` later; arrival order is preserved, as on one TCP connection.
Two emulated nodes talking to each other therefore see the sum of both access links, like two
home connections on either side of the internet.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agora_core import world
from agora_core.observability.logs import get_logger

log = get_logger("linkemu")


@dataclass(kw_only=True, frozen=True)
class LinkConfig:
    up_bits_per_s: float | None = None  # None: unlimited
    down_bits_per_s: float | None = None
    latency_s: float = 0.0  # one way, added in each direction of this node's link
    jitter_s: float = 0.0  # uniform in [-jitter, +jitter], never reordering messages
    seed: int | None = None  # for reproducible jitter

    def __post_init__(self) -> None:
        for name in ("up_bits_per_s", "down_bits_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"LinkConfig.{name} must be positive or None")
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError("LinkConfig latency_s and jitter_s must be >= 0")

    @property
    def is_ideal(self) -> bool:
        return (
            self.up_bits_per_s is None
            and self.down_bits_per_s is None
            and self.latency_s == 0
            and self.jitter_s == 0
        )

    @classmethod
    def parse(cls, spec: str) -> LinkConfig:
        """Parse ``up=200M,down=200M,latency=50ms,jitter=5ms`` (units: k/M/G bits, ms/s)."""
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, raw = part.partition("=")
            if not sep:
                raise ValueError(f"link spec item {part!r} is not key=value")
            key = key.strip()
            if key in ("up", "down"):
                values[f"{key}_bits_per_s"] = _parse_rate(raw)
            elif key in ("latency", "jitter"):
                values[f"{key}_s"] = _parse_seconds(raw)
            else:
                raise ValueError(f"unknown link spec key {key!r}: use up, down, latency, jitter")
        return cls(**values)


def _parse_rate(raw: str) -> float:
    raw = raw.strip().removesuffix("bit/s").removesuffix("bps")
    scale = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9}.get(raw[-1:], 1.0)
    return float(raw[:-1] if scale != 1.0 else raw) * scale


def _parse_seconds(raw: str) -> float:
    raw = raw.strip()
    if raw.endswith("ms"):
        return float(raw[:-2]) / 1e3
    return float(raw.removesuffix("s"))


class _Pipe:
    """One direction of a link: computes when a message of n bytes arrives at the far end."""

    def __init__(self, rate_bits_per_s: float | None, latency_s: float, jitter_s: float, rng):
        self._rate = rate_bits_per_s
        self._latency = latency_s
        self._jitter = jitter_s
        self._rng = rng
        self._free_at = 0.0  # when the pipe finishes serializing the previous message
        self._last_arrival = 0.0

    def arrival_time(self, nbytes: int, now: float) -> float:
        start = max(now, self._free_at)
        done = start + (nbytes * 8 / self._rate if self._rate else 0.0)
        self._free_at = done
        delay = self._latency + (self._rng.uniform(-self._jitter, self._jitter) if self._jitter else 0)
        arrival = max(done + max(delay, 0.0), self._last_arrival)
        self._last_arrival = arrival
        return arrival


class DelayLine:
    """Runs ``deliver(item)`` for queued items in order, each no earlier than its arrival time.

    Owned by one asyncio task; items are appended in arrival-time order by construction.
    """

    def __init__(self, pipe: _Pipe, deliver: Callable[[Any], Awaitable[None] | None]):
        self._pipe = pipe
        self._deliver = deliver
        self._queue: collections.deque[tuple[float, Any]] = collections.deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._pump(), name="link-delay-line")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._queue.clear()

    def put(self, item: Any, nbytes: int) -> None:
        self._queue.append((self._pipe.arrival_time(nbytes, world.monotonic()), item))
        self._wakeup.set()

    async def _pump(self) -> None:
        while True:
            if not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            arrival, item = self._queue[0]
            wait = arrival - world.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._queue.popleft()
            try:
                result = self._deliver(item)
                if result is not None:
                    await result
            except Exception as exc:  # like a packet lost on the link: the caller's deadline acts
                log.debug("link_delivery_failed", error=f"{type(exc).__name__}: {exc}")


class LinkEmulator:
    """Upload and download pipes of one node; makes :class:`DelayLine` objects for a socket."""

    def __init__(self, config: LinkConfig):
        self.config = config
        rng = world.rng(config.seed)
        self._up = _Pipe(config.up_bits_per_s, config.latency_s, config.jitter_s, rng)
        self._down = _Pipe(config.down_bits_per_s, config.latency_s, config.jitter_s, rng)

    def upload_line(self, deliver) -> DelayLine:
        return DelayLine(self._up, deliver)

    def download_line(self, deliver) -> DelayLine:
        return DelayLine(self._down, deliver)
