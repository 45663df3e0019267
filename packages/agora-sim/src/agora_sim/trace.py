"""The simulation's event trace, folded into one digest: the same scenario and seed must give
the same digest, bit for bit, or something outside virtual time leaked in."""

from __future__ import annotations

import hashlib
import struct

_EVENT = struct.Struct("<qBII")  # virtual time in ns, kind, source, destination


class Trace:
    """Counts and digests every network event: messages sent, delivered and dropped, connection
    changes, faults. Hosts appear by their index (stable for a scenario and seed)."""

    SENT, DELIVERED, DROPPED, CONNECTED, LOST, REFUSED, FAULT, REJECTED = range(8)

    def __init__(self) -> None:
        self._hash = hashlib.blake2b(digest_size=16)
        self.events = 0
        self.messages = 0
        self.bytes = 0
        self.dropped = 0

    def record(self, time_s: float, kind: int, src: int, dst: int, payload: bytes = b"") -> None:
        self.events += 1
        self._hash.update(_EVENT.pack(round(time_s * 1e9), kind, src, dst))
        if payload:
            self._hash.update(payload)

    def message(self, time_s: float, src: int, dst: int, header: bytes, nbytes: int) -> None:
        self.messages += 1
        self.bytes += nbytes
        self.record(time_s, self.SENT, src, dst, header)

    def drop(self, time_s: float, src: int, dst: int) -> None:
        self.dropped += 1
        self.record(time_s, self.DROPPED, src, dst)

    def digest(self) -> str:
        return self._hash.copy().hexdigest()
