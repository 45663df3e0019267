"""Matchmaking: who averages together in a round, in an order every member derives alike.

Each peer announces itself for the round under its own signed subkey of the round's DHT key
(address, weight = samples since its last round, its phase) and reads the others' until the
stage's expected workers are all there or the window closes. The group is what it then sees,
ordered by node id; its hash travels with every stream, so a peer that formed a different
group (it came late, or saw a straggler the others did not) is refused by the reducers and
told so, and averages nothing this round.

What a peer says about itself is not what puts it in the group. An entry counts only when it
names the node whose key wrote it, and, in an authorized run, only when that node holds a
worker's credential for this stage (the authorizer's placement, as the DHT's member table
knows it): a node of another stage, a trainer, or one naming another cannot join. Who reduces
is the run config's ``averaging.reducers`` for each member's id, whatever the entry declares.
A weight is declared, and bounded where it is used (``robust.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from agora_core import world
from agora_core.contract import Phase
from agora_core.dht import DhtNode, RecordRejected
from agora_core.dht.owned import OwnedEntry
from agora_core.dht.values import DhtValue
from agora_core.identity import NodeKey, node_id_from_public_key
from agora_core.observability.logs import get_logger
from agora_core.schema import averaging_round_key

log = get_logger("averaging.matchmaking")


@dataclass(frozen=True, kw_only=True)
class Peer:
    node_id: str
    address: str
    weight: float  # samples processed since its last round; 0 for peers in weight sync
    reducer: bool  # may reduce a slice: declared, then set by the group from the run config
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


def _anyone_reduces(_node_id: str) -> bool:
    return True


class Matchmaker:
    def __init__(
        self,
        *,
        dht: DhtNode,
        key: NodeKey,
        run_name: str,
        stage: int,
        ttl_s: float,
        poll_s: float = 0.05,
        reduces: Callable[[str], bool] = _anyone_reduces,
    ):
        """``ttl_s``: the run's dht.record_ttl_s, longer than any window (the run config checks);
        ``reduces(node_id)``: whether the run config lets that member reduce."""
        self._dht = dht
        self._ttl_s = ttl_s
        self._key = key
        self._run_name = run_name
        self._stage = stage
        self._poll_s = poll_s
        self._reduces = reduces

    def _refusal(self, entry: DhtValue, peer: Peer) -> str | None:
        """Why ``peer``'s entry does not put it in the group; None when it does."""
        if entry.owner is None or node_id_from_public_key(entry.owner) != peer.node_id:
            return "it names another node than the one that wrote it"
        if self._dht.verifier is None:  # an open run: nobody holds a credential
            return None
        identity = self._dht.identity_of(peer.node_id)
        if identity is None:
            return "no credential of this run's members"
        if identity.role != "worker" or identity.stage != self._stage:
            return f"its credential is a {identity.role}'s for stage {identity.stage}, not this stage's"
        return None

    def peers(self, values: Mapping[str, DhtValue], refused: dict[str, str] | None = None) -> dict[str, Peer]:
        """The round's entries that put their writers in the group, by node id, each reducer
        role the run config's; ``refused`` collects the others (node id -> why)."""
        found: dict[str, Peer] = {}
        for entry in values.values():
            try:
                peer = Peer.from_value(entry.value)
            except RecordRejected:
                continue
            why = self._refusal(entry, peer)
            if why is not None:
                if refused is not None:
                    refused[peer.node_id] = why
                continue
            found[peer.node_id] = dataclasses.replace(peer, reducer=self._reduces(peer.node_id))
        return found

    async def form_group(self, round_index: int, me: Peer, *, expected: set[str], window_s: float) -> Group:
        """Announce ``me`` and return the round's group (``me`` is always in it)."""
        entry = OwnedEntry(
            self._dht, self._key, averaging_round_key(self._run_name, self._stage, round_index)
        )
        await entry.publish(asdict(me), self._ttl_s)
        deadline = world.monotonic() + window_s
        refused: dict[str, str] = {}
        me = dataclasses.replace(me, reducer=self._reduces(me.node_id))
        while True:
            peers = self.peers(await entry.read_all(), refused)
            peers[me.node_id] = me
            if expected <= peers.keys() or world.monotonic() >= deadline:
                for node_id, why in sorted(refused.items()):
                    log.warning("matchmaking_entry_refused", round=round_index, node=node_id, reason=why)
                return Group(round_index, tuple(sorted(peers.values(), key=lambda p: p.node_id)))
            await asyncio.sleep(self._poll_s)
