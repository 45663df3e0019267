"""The frames a simulated endpoint receives: what a ``zmq.Frame`` offers the RPC layer."""

from __future__ import annotations


class SimFrame(bytearray):
    """A received frame: a writable buffer (as a ``zmq.Frame``'s is: decoded tensors may be
    written in place), with the ``.bytes`` a ``zmq.Frame`` has."""

    __slots__ = ()

    @property
    def bytes(self) -> bytes:
        return bytes(self)

    def get(self, name: str) -> str | None:
        return None  # an open connection's frames carry no properties


class CallerFrame(SimFrame):
    """A frame received on a secured connection: it names the caller's key as the ZAP handler
    admitted it (hex), the ``User-Id`` a CURVE server reads."""

    __slots__ = ("user_id",)

    def get(self, name: str) -> str | None:
        return self.user_id if name == "User-Id" else None
