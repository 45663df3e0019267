"""A peer's authenticated identity: what its credential says (imports nothing, so that the
RPC layer's request type can carry it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTHORIZER_ROLE = "authorizer"  # the run's authorizer: its key is the run's, it holds no credential


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    """A peer as its credential describes it (the authorizer: role ``authorizer``)."""

    node_id: str
    public_key: bytes
    role: str
    stage: int | None
    expires: float  # wall-clock seconds; inf for the authorizer
    serial: int | None = None
    account: str = ""
    renew_at: float = math.inf  # wall-clock: past it, ask the peer for its refreshed credential

    def valid(self, now: float) -> bool:
        return now < self.expires
