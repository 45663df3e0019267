"""Who a peer is, in an authorized run: its key, the role and stage its credential names, and
until when — checked against the run's authorizer key and its revocation list.

Every node of an authorized run asks this of every peer: the transport when a connection
presents a credential, the DHT when a member's claim carries one. A credential is verified
once (its signature is the expensive part) and remembered by its bytes, so the same
credential arriving through many connections and gossip messages costs one check. The
authorizer itself holds no credential: its key is the run's, named in the run config.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agora_core import world
from agora_core.admission.credential import CredentialError, SignedCredential, verify_credential
from agora_core.admission.signed import SignedMessage
from agora_core.auth.peer_identity import AUTHORIZER_ROLE, PeerIdentity
from agora_core.identity import node_id_from_public_key

if TYPE_CHECKING:  # the revocation list lives with the DHT's records, which need the RPC layer
    from agora_core.admission.revocations import Revocations
_CACHE_ENTRIES = 4096
RENEW_AT = 0.8  # of a peer's credential's lifetime


class PeerVerifier:
    """The credential checks of one run (``run``, signed by ``authorizer_key``)."""

    def __init__(self, *, run: str, authorizer_key: bytes, max_clock_skew_s: float = 5.0):
        self.run = run
        self.authorizer_key = authorizer_key
        self.max_clock_skew_s = max_clock_skew_s
        self.authorizer = PeerIdentity(
            node_id=node_id_from_public_key(authorizer_key),
            public_key=authorizer_key,
            role=AUTHORIZER_ROLE,
            stage=None,
            expires=math.inf,
        )
        self._verified: collections.OrderedDict[bytes, SignedCredential] = collections.OrderedDict()
        self.revocations: Revocations | None = None
        self._revocation_listeners: list[Callable[[Revocations], None]] = []

    def identify(self, public_key: bytes, credential: Any, now: float | None = None) -> PeerIdentity:
        """The identity of the holder of ``public_key`` presenting ``credential`` (a signed
        credential's map; None for the authorizer). Raises :class:`CredentialError`: no
        credential, forged, another run's, expired, issued to another key, or revoked."""
        if public_key == self.authorizer_key:
            return self.authorizer
        if credential is None:
            raise CredentialError("missing", "no credential: this run admits credentialed nodes only")
        now = world.wall() if now is None else now
        signed = self._verify(credential, now)
        found = signed.credential
        if found.public_key != public_key:
            raise CredentialError("wrong_key", "the credential was issued to another key")
        identity = PeerIdentity(
            node_id=found.node_id,
            public_key=found.public_key,
            role=found.role,
            stage=found.stage,
            expires=found.expires + self.max_clock_skew_s,
            serial=found.serial,
            account=found.account,
            # its holder refreshes at 2/3 of the credential's life: ask for the new one after
            renew_at=found.issued + RENEW_AT * found.lifetime_s,
        )
        if not identity.valid(now):
            raise CredentialError("expired", f"the credential expired {now - found.expires:.0f} s ago")
        if self.revoked(identity):
            raise CredentialError("revoked", "the credential's node or account is on the revocation list")
        return identity

    def _verify(self, credential: Any, now: float) -> SignedCredential:
        message = SignedMessage.from_value(credential)
        cache_key = None if message is None else message.body + message.signature
        cached = self._verified.get(cache_key) if cache_key is not None else None
        if cached is not None:
            self._verified.move_to_end(cache_key)
            return cached
        signed = verify_credential(
            credential,
            authorizer_public_key=self.authorizer_key,
            run=self.run,
            now=now,
            max_clock_skew_s=self.max_clock_skew_s,
        )
        self._verified[cache_key] = signed
        while len(self._verified) > _CACHE_ENTRIES:
            self._verified.popitem(last=False)
        return signed

    # --- revocations -----------------------------------------------------------------------------

    def revoked(self, identity: PeerIdentity) -> bool:
        if identity.role == AUTHORIZER_ROLE or self.revocations is None:
            return False
        return self.revocations.revokes(identity.node_id, identity.account or None)

    def observe(self, revocations: Revocations | None) -> None:
        """A revocation list just read from the DHT: peers it names are dropped (listeners)."""
        previous = self.revocations
        if revocations is None or (previous is not None and revocations.updated < previous.updated):
            return
        changed = previous is None or (revocations.nodes, revocations.accounts) != (
            previous.nodes,
            previous.accounts,
        )
        self.revocations = revocations
        if changed:
            for listener in self._revocation_listeners:
                listener(revocations)

    def on_revocations(self, listener: Callable[[Revocations], None]) -> None:
        self._revocation_listeners.append(listener)
