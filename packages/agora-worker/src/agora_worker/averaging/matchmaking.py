"""Matchmaking: who averages together in a round, in an order every member derives alike.

Each peer announces itself for the round under its own signed subkey of the round's DHT key
(address, weight = samples since its last round, whether it may reduce, its phase) and reads
the others' until the stage's expected workers are all there or the window closes. The group
is what it then sees, ordered by node id; its hash travels with every stream, so a peer that
formed a different group (it came late, or saw a straggler the others did not) is refused by
the reducers and told so, and averages nothing this round.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import asdict, dataclass

from agora_core import world
from agora_core.contract import Phase
from agora_core.dht import DhtNode, RecordRejected
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.schema import averaging_round_key, parse_entries


@dataclass(frozen=True, kw_only=True)
class Peer:
    node_id: str
    address: str
    weight: float  # samples processed since its last round; 0 for peers in weight sync
    reducer: bool  # may reduce a slice
    phase: Phase

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))  # a phase given by name

    @classmethod
    def from_value(cls, value: object) -> Peer:
        """A peer's matchmaking entry; ``RecordRejected`` when it is malformed."""
        if not isinstance(value, dict):
            raise RecordRejected("a matchmaking entry must be a map")
        try:
            peer = cls(
                node_id=str(value["node_id"]),
                address=str(value["address"]),
                weight=float(value["weight"]),
                reducer=bool(value["reducer"]),
                phase=Phase(value["phase"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordRejected(f"malformed matchmaking entry: {exc!r}") from None
        if peer.weight < 0:
            raise RecordRejected("a peer's weight must be >= 0")
        return peer


@dataclass(frozen=True)
class Group:
    round: int
    members: tuple[Peer, ...]  # ordered by node id

    @property
    def reducers(self) -> tuple[Peer, ...]:
        return tuple(m for m in self.members if m.reducer)

    @property
    def digest(self) -> str:
        """Identifies the layout: members, their weights and who reduces."""
        text = repr([(m.node_id, m.weight, m.reducer) for m in self.members])
        return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()

    def member(self, node_id: str) -> Peer | None:
        return next((m for m in self.members if m.node_id == node_id), None)


class Matchmaker:
    def __init__(
        self, *, dht: DhtNode, key: NodeKey, run_name: str, stage: int, ttl_s: float, poll_s: float = 0.05
    ):
        """``ttl_s``: the run's dht.record_ttl_s, longer than any window (the run config checks)."""
        self._dht = dht
        self._ttl_s = ttl_s
        self._key = key
        self._run_name = run_name
        self._stage = stage
        self._poll_s = poll_s

    async def form_group(self, round_index: int, me: Peer, *, expected: set[str], window_s: float) -> Group:
        """Announce ``me`` and return the round's group (``me`` is always in it)."""
        entry = OwnedEntry(
            self._dht, self._key, averaging_round_key(self._run_name, self._stage, round_index)
        )
        await entry.publish(asdict(me), self._ttl_s)
        deadline = world.monotonic() + window_s
        while True:
            peers = {peer.node_id: peer for peer in parse_entries(await entry.read_all(), Peer.from_value)}
            peers[me.node_id] = me
            if expected <= peers.keys() or world.monotonic() >= deadline:
                return Group(round_index, tuple(sorted(peers.values(), key=lambda p: p.node_id)))
            await asyncio.sleep(self._poll_s)
