"""One member of a DHT's membership as it travels: its update, and the checks of its shape.

``[node id, address, public key, incarnation, status, signature, credential]``: the node id
is the BLAKE2b-160 hash of the public key (checked here, so ids are not chosen); the
signature is the member's own over its ALIVE or LEFT claim (``claims``); the credential is
the authorizer's signed credential value its claim names (nil in an open run).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agora_core.dht.ids import node_position
from agora_core.identity import node_id_from_public_key

if TYPE_CHECKING:
    from agora_core.auth.peers import PeerIdentity

MAX_UPDATES_PER_MESSAGE = 1024
MAX_ADDRESS_CHARS = 256


class Status(enum.IntEnum):
    ALIVE = 0
    SUSPECT = 1
    DEAD = 2
    LEFT = 3


GONE = (Status.DEAD, Status.LEFT)
HINTS = (Status.SUSPECT, Status.DEAD)


@dataclass(slots=True)
class Member:
    node_id: str
    address: str
    public_key: bytes
    incarnation: int
    status: Status
    signature: bytes | None = None  # the member's own, over its ALIVE (or LEFT) claim
    credential: Any = None  # the signed credential value its claim names (authorized runs)
    changed_at: float = 0.0  # world.monotonic() of the last status change (suspicion timers)
    identity: PeerIdentity | None = field(default=None, repr=False)  # from its credential
    expires: float = math.inf  # wall-clock seconds its credential stops counting
    revoked: bool = False
    hearsay: bool = False  # a tombstone only others' reports put here (its own claim lifts it)

    @property
    def position(self) -> int:
        return node_position(self.node_id)

    def to_wire(self) -> list:
        return [
            self.node_id,
            self.address,
            self.public_key,
            self.incarnation,
            int(self.status),
            self.signature,
            self.credential,
        ]


def parse_update(raw: Any) -> Member | None:
    """A member update from the wire, or None when malformed (it is then ignored).

    Only shapes are checked here (no signature): the node id must be the hash of the key.
    """
    if not isinstance(raw, list) or len(raw) != 7:
        return None
    node_id, address, public_key, incarnation, status, signature, credential = raw
    if (
        not isinstance(node_id, str)
        or len(node_id) != 40
        or not isinstance(address, str)
        or not 0 < len(address) <= MAX_ADDRESS_CHARS
        or not isinstance(public_key, bytes)
        or len(public_key) != 32
        or isinstance(incarnation, bool)
        or not isinstance(incarnation, int)
        or not 0 <= incarnation < 1 << 63
        or status not in (0, 1, 2, 3)
        or not (signature is None or (isinstance(signature, bytes) and len(signature) == 64))
        or not (credential is None or isinstance(credential, dict))
    ):
        return None
    if node_id_from_public_key(public_key) != node_id:
        return None  # ids are not chosen: nobody places itself next to a key
    return Member(node_id, address, public_key, incarnation, Status(status), signature, credential)


@dataclass(slots=True)
class Budget:
    """How many claims one message may still have checked (bounds the work it can cause)."""

    checks_left: int

    def take(self) -> bool:
        if self.checks_left <= 0:
            return False
        self.checks_left -= 1
        return True


def overrides(new: Member, old: Member) -> bool:
    """SWIM precedence of a member's own claim (ALIVE or LEFT) over what is held."""
    if new.status == Status.ALIVE:
        return new.incarnation > old.incarnation or (old.hearsay and new.incarnation == old.incarnation)
    # LEFT
    if old.status in GONE:
        return new.incarnation > old.incarnation or (new.status == Status.LEFT and old.status == Status.DEAD)
    return new.incarnation >= old.incarnation
