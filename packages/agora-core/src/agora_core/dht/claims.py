"""A member's own claims about itself: signed ALIVE and LEFT, checked before they count.

A member's claim names the run, its node id (the hash of its key), its address, its
incarnation, ALIVE or LEFT, and — in an authorized run — the credential it holds; the member
signs it with its own Ed25519 key, so nobody else can raise its incarnation, move its
address, or say it left. Reports by others (SUSPECT, DEAD) are not claims: they travel with
the member's last ALIVE claim and its signature, and count only as hints.

In an authorized run (a :class:`PeerVerifier`), a claim counts only with a valid credential
for the member's key (the authorizer's own key needs none). Checks go cheapest first: the
shape of the credential before any signature, then the member's signature, then the
credential's (the verifier remembers credentials it has checked). Claims refused after a
signature check are remembered too (by everything they say), so gossip that repeats one costs
one check.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack

from agora_core.admission.credential import CredentialError
from agora_core.admission.signed import SignedMessage
from agora_core.identity import NodeKey, verify_signature

if TYPE_CHECKING:
    from agora_core.auth.peers import PeerIdentity, PeerVerifier
    from agora_core.dht.membership import Member

CONTEXT = b"agora-dht-claim-v1"
ALIVE, LEFT = 0, 3  # the statuses a member claims about itself (membership.Status values)
REFUSED_ENTRIES = 4096  # claims remembered as refused


def credential_digest(credential: Any) -> bytes:
    """What a claim's signature binds of its credential: a hash of the signed credential."""
    message = SignedMessage.from_value(credential)
    if message is None:
        return b""
    return hashlib.blake2b(message.body + message.signature, digest_size=16).digest()


def claim_payload(
    run: str, node_id: str, address: str, incarnation: int, claimed: int, credential: Any
) -> bytes:
    return msgpack.packb(
        [CONTEXT, run, node_id, address, incarnation, claimed, credential_digest(credential)],
        use_bin_type=True,
    )


def claimed_status(status: int) -> int:
    """The claim an update's signature covers: LEFT for a departure, ALIVE for the rest
    (a SUSPECT or DEAD report carries the ALIVE claim it is about)."""
    return LEFT if status == LEFT else ALIVE


class Claims:
    """Signs this node's claims and checks everyone else's, for one run."""

    def __init__(
        self,
        *,
        key: NodeKey,
        verifier: PeerVerifier | None = None,
        credential: Callable[[], Any] | None = None,
        on_reject: Callable[[str], None] | None = None,
    ):
        """``credential()``: this node's current signed credential value (None in open mode
        and for the authorizer); ``on_reject(reason)``: told of every claim refused."""
        self.key = key
        self.verifier = verifier
        self.run = verifier.run if verifier is not None else ""
        self._credential = credential or (lambda: None)
        self._on_reject = on_reject or (lambda reason: None)
        self._refused: collections.OrderedDict[tuple, str] = collections.OrderedDict()

    def sign(self, me: Member) -> None:
        """(Re-)sign this node's claim at its current incarnation, with its current credential."""
        me.credential = self._credential()
        me.signature = self.key.sign(
            claim_payload(
                self.run, me.node_id, me.address, me.incarnation, claimed_status(me.status), me.credential
            )
        )
        me.identity = self._identify(me)
        me.expires = math.inf  # this node does not drop itself; the others check its credential

    def mine(self, update: Member) -> bool:
        """Whether ``update`` carries a claim this node's own key signed: a previous life's
        (its incarnation may be above this life's)."""
        return (
            update.signature is not None
            and update.public_key == self.key.public_key
            and self._signed_by_its_key(update)
        )

    def _signed_by_its_key(self, update: Member) -> bool:
        payload = claim_payload(
            self.run,
            update.node_id,
            update.address,
            update.incarnation,
            claimed_status(update.status),
            update.credential,
        )
        return verify_signature(update.public_key, payload, update.signature)

    def plausible(self, update: Member) -> bool:
        """Cheap shape checks, before any signature is looked at."""
        if update.signature is None:
            return self._reject("unsigned")
        if self.verifier is None or update.public_key == self.verifier.authorizer_key:
            return True
        if SignedMessage.from_value(update.credential) is None:
            return self._reject("missing" if update.credential is None else "malformed")
        return True

    def admit(self, update: Member) -> bool:
        """Whether ``update`` is its member's own signed claim (and, in an authorized run,
        carries a valid credential for its key); sets its identity and expiry when it is."""
        if not self.plausible(update):
            return False
        claimed = claimed_status(update.status)
        seen = (update.node_id, update.address, update.incarnation, claimed, update.signature)
        seen += (credential_digest(update.credential),)
        if seen in self._refused:
            return self._reject(self._refused[seen])
        if not self._signed_by_its_key(update):
            return self._refuse(seen, "bad_claim_signature")
        if self.verifier is None:
            update.identity, update.expires = None, math.inf
            return True
        try:
            identity = self.verifier.identify(update.public_key, update.credential)
        except CredentialError as exc:
            return self._refuse(seen, exc.reason)
        update.identity, update.expires = identity, identity.expires
        return True

    def _refuse(self, seen: tuple, reason: str) -> bool:
        self._refused[seen] = reason
        while len(self._refused) > REFUSED_ENTRIES:
            self._refused.popitem(last=False)
        return self._reject(reason)

    def _identify(self, member: Member) -> PeerIdentity | None:
        if self.verifier is None:
            return None
        try:
            return self.verifier.identify(member.public_key, member.credential)
        except CredentialError:
            return None

    def revoked(self, identity: PeerIdentity | None) -> bool:
        return self.verifier is not None and identity is not None and self.verifier.revoked(identity)

    def _reject(self, reason: str) -> bool:
        self._on_reject(reason)
        return False
