"""Authentication in an authorized run: who a peer is (:mod:`.peers`), and the encrypted,
mutually authenticated transport built on it (ZeroMQ CURVE keys derived from each node's
Ed25519 key, a ZAP handler, and a credential exchange on every new connection)."""

from agora_core.auth.peer_identity import AUTHORIZER_ROLE, PeerIdentity
from agora_core.auth.peers import PeerVerifier

__all__ = ["AUTHORIZER_ROLE", "PeerIdentity", "PeerVerifier"]
