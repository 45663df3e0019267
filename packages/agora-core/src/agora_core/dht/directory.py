"""Who is who in a node's member table: the key expected at an address, and who may write.

The transport asks which public key to expect at an address (its CURVE server key); the
record store asks, in an authorized run, whether a record's writer is a credentialed member
this node knows (any status not yet forgotten, unless revoked) or the authorizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agora_core.dht.membership import GONE, MemberTable
from agora_core.dht.records import RecordRejected
from agora_core.identity import node_id_from_public_key
from agora_core.wire.addresses import normalize_address

if TYPE_CHECKING:
    from agora_core.auth.peers import PeerVerifier


def key_for_address(table: MemberTable, address: str) -> bytes | None:
    """The key of the member at ``address``: live members first, then tombstones, the first
    to claim the address among equals; revoked members never."""
    wanted = normalize_address(address)
    found = None
    for member in table.known():
        if member.revoked or normalize_address(member.address) != wanted:
            continue
        if member.status not in GONE or (table.leaving and member is table.me):
            return member.public_key
        found = found or member.public_key
    return found


def check_writer(
    table: MemberTable | None, verifier: PeerVerifier | None, own_key: bytes, writer: bytes | None
) -> None:
    """An authorized run's writer policy (RecordRejected unless the writer may write): the
    record is signed, by this node, the authorizer, or a credentialed member known here."""
    if verifier is None or writer == own_key or writer == verifier.authorizer_key:
        return
    if writer is None:
        raise RecordRejected("unsigned record: this run takes records signed by its members only")
    node_id = node_id_from_public_key(writer)
    member = table.get(node_id) if table is not None else None
    if member is None or member.public_key != writer or member.identity is None or member.revoked:
        raise RecordRejected(f"writer {node_id[:12]} is not a credentialed member this node knows")
