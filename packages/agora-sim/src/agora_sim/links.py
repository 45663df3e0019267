"""A simulated host's access link and the delay of one message over a path of two of them.

A message from host A to host B waits for A's upload pipe (serialized at A's upload rate after
whatever A sent before it), crosses the internet in A's one-way latency plus B's (each with
its jitter), then waits for B's download pipe. ``loss`` is the fraction of messages whose TCP
segments are lost on the way: over TCP nothing vanishes, so each costs a retransmission
timeout instead. The same shape as :mod:`agora_core.rpc.linkemu`, computed instead of slept.

``window_bytes`` is the TCP window a host's connections get (the smaller of the two ends'
on a path): a connection has at most that much unacknowledged, so its stream moves at most a
window per round trip, whatever the pipes allow. A long path caps a bulk transfer this way,
not only delays it; :class:`StreamWindow` is that cap on one direction of one connection.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# TCP's minimum retransmission timeout (RFC 6298 recommends 1 s; Linux uses 200 ms).
MIN_RTO_S = 0.2


@dataclass(kw_only=True, frozen=True)
class LinkModel:
    up_bits_per_s: float | None = None  # None: unlimited
    down_bits_per_s: float | None = None
    latency_s: float = 0.0  # one way: this host's share of every path's delay
    jitter_s: float = 0.0  # uniform in [-jitter, +jitter] per message, never reordering a connection
    loss: float = 0.0  # fraction of messages that need a TCP retransmission
    window_bytes: int | None = None  # TCP window of this host's connections; None: unlimited

    def __post_init__(self) -> None:
        for name in ("up_bits_per_s", "down_bits_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"LinkModel.{name} must be positive or None")
        if self.latency_s < 0 or self.jitter_s < 0:
            raise ValueError("LinkModel latency_s and jitter_s must be >= 0")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError("LinkModel.loss must be in [0, 1)")
        if self.window_bytes is not None and self.window_bytes <= 0:
            raise ValueError("LinkModel.window_bytes must be positive or None")

    def upload_s(self, nbytes: int) -> float:
        return 0.0 if self.up_bits_per_s is None else nbytes * 8 / self.up_bits_per_s

    def download_s(self, nbytes: int) -> float:
        return 0.0 if self.down_bits_per_s is None else nbytes * 8 / self.down_bits_per_s


class LinkState:
    """One host's link while the simulation runs: when each of its pipes is free again."""

    def __init__(self, model: LinkModel):
        self.model = model
        self.up_free_at = 0.0
        self.down_free_at = 0.0

    def departure(self, now: float, nbytes: int) -> float:
        """When a message of ``nbytes`` handed over ``now`` has left this host's upload pipe."""
        self.up_free_at = max(now, self.up_free_at) + self.model.upload_s(nbytes)
        return self.up_free_at

    def delivery(self, arrived: float, nbytes: int) -> float:
        """When a message that reached this host's link at ``arrived`` is through its download pipe."""
        self.down_free_at = max(arrived, self.down_free_at) + self.model.download_s(nbytes)
        return self.down_free_at


class StreamWindow:
    """One direction of one connection under a TCP window: a window's worth of bytes may leave
    at once, then bytes leave at a window per round trip (a token bucket of one window that
    refills in a round trip; ``credit`` goes negative while a message waits for its acks)."""

    __slots__ = ("credit", "rate", "updated", "window")

    def __init__(self, window_bytes: int, round_trip_s: float):
        self.window = float(window_bytes)
        self.rate = self.window / round_trip_s if round_trip_s > 0 else float("inf")
        self.credit = self.window
        self.updated = 0.0

    def release(self, now: float, nbytes: int) -> float:
        """When the last byte of a message of ``nbytes`` handed over ``now`` may be sent."""
        if self.rate == float("inf"):
            return now
        self.credit = min(self.window, self.credit + (now - self.updated) * self.rate) - nbytes
        self.updated = now
        return now if self.credit >= 0 else now - self.credit / self.rate


def path_window(src: LinkModel, dst: LinkModel) -> int | None:
    """The window a connection between two hosts gets: the smaller end's (None: unlimited)."""
    windows = [w for w in (src.window_bytes, dst.window_bytes) if w is not None]
    return min(windows) if windows else None


def one_way_s(src: LinkModel, dst: LinkModel) -> float:
    return src.latency_s + dst.latency_s


def crossing_s(src: LinkModel, dst: LinkModel, rng: random.Random) -> float:
    """The internet part of one message's trip: both latencies, their jitter, and a TCP
    retransmission where a segment was lost."""
    delay = one_way_s(src, dst)
    for model in (src, dst):
        if model.jitter_s:
            delay += rng.uniform(-model.jitter_s, model.jitter_s)
        if model.loss and rng.random() < model.loss:
            delay += max(MIN_RTO_S, 4 * one_way_s(src, dst))  # RTO ~ 2 round trips
    return max(0.0, delay)
