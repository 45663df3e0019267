"""The transport's security in an authorized run: CURVE keys, who may connect, who called.

Every connection is a ZeroMQ CURVE session (encrypted, and bound to both ends' keys by the
handshake), and its first message is a greeting (``auth.hello``) in each direction: the
caller presents its credential, the server answers with its own, and each checks the other's
against the run's authorizer key, the key the handshake proved, and the clock. From then on
the server knows each message's caller by the key its connection was made with (the
``User-Id`` the ZAP handler gave it), so ``request.sender`` is an authenticated node id,
never a claimed one, and no message is signed on the hot path.

A captured handshake or message cannot be replayed on another connection: CURVE keys each
session with fresh short-term keys. A key whose greeting was refused is refused at the
handshake for a while (``refused_for_s``), and a revoked peer's key from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agora_core import world
from agora_core.admission.credential import CredentialError
from agora_core.auth.curve import curve_keypair, curve_public_key
from agora_core.auth.peers import PeerIdentity, PeerVerifier
from agora_core.errors import PeerRefused, Unauthenticated
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.wire.addresses import normalize_address

if TYPE_CHECKING:
    from agora_core.admission.revocations import Revocations

log = get_logger("auth")

HELLO_METHOD = "auth.hello"
REFUSED_KEYS = 1024  # refused keys remembered before the expired ones are forgotten
KEY_SEPARATOR = "@"  # "<hex Ed25519 public key>@<address>": a peer address that names its key
Resolver = Callable[[str], "bytes | None"]  # address -> the Ed25519 key of the node there


def parse_peer_address(spec: str) -> tuple[str, bytes | None]:
    """``"<64 hex>@tcp://host:port"`` -> (address, key); a plain address -> (address, None)."""
    if KEY_SEPARATOR not in spec:
        return spec, None
    hex_key, address = spec.split(KEY_SEPARATOR, 1)
    try:
        key = bytes.fromhex(hex_key)
    except ValueError:
        raise ValueError(f"{spec!r}: the part before '@' must be the node's hex public key") from None
    if len(key) != 32 or not address:
        raise ValueError(f"{spec!r}: expected <64 hex digits>@<host:port>")
    return address, key


class TransportSecurity:
    """One node's side of every authenticated connection (its server's and its client's)."""

    def __init__(
        self,
        *,
        key: NodeKey,
        verifier: PeerVerifier,
        credential: Callable[[], Any] = lambda: None,
        max_clock_skew_s: float = 10.0,
        refused_for_s: float = 30.0,
        recheck_s: float = 1.0,
        clock: Callable[[], float] | None = None,
    ):
        self.key = key
        self.verifier = verifier
        self.credential = credential  # this node's current signed credential (None: authorizer, joiner)
        self.max_clock_skew_s = max_clock_skew_s
        self.refused_for_s = refused_for_s
        self.recheck_s = recheck_s  # how often a client looks at its peers' credentials
        # the wall clock this node presents and checks others' against (world's: a simulated
        # host's own, skew included)
        self.clock = clock or (lambda: world.wall())
        self.curve_public, self.curve_secret = curve_keypair(key)
        self._callers: dict[str, PeerIdentity] = {}  # hex X25519 key -> identity (greeted)
        self._refused: dict[bytes, float] = {}  # X25519 key -> refused until (monotonic; inf)
        self._expected: dict[str, tuple[bytes, bool]] = {}  # address -> (key, must be credentialed)
        self._resolvers: list[Resolver] = []
        self._credential_listeners: list[Callable[[], None]] = []
        self._revocation_listeners: list[Callable[[Revocations], None]] = []
        verifier.on_revocations(self._revoked)

    # --- the server side ------------------------------------------------------------------------

    def admits(self, client_key: bytes) -> bool:
        """The ZAP policy (on the ZAP thread): refuse keys refused or revoked lately."""
        until = self._refused.get(client_key)
        return until is None or until < world.monotonic()

    def caller(self, user_id: str | None, now: float) -> PeerIdentity | None:
        """Who sent a message on the connection of ``user_id``: None when it never presented
        a credential, or its credential expired since."""
        identity = self._callers.get(user_id) if user_id else None
        if identity is None:
            return None
        if not identity.valid(now):
            del self._callers[user_id]
            return None
        return identity

    def greet(self, user_id: str | None, meta: Any, *, anonymous_ok: bool) -> dict:
        """Answer a caller's greeting: check its key, clock and credential, remember who it
        is, and present ours. Raises Unauthenticated (and refuses the key for a while)."""
        if not user_id:
            raise Unauthenticated("this connection carries no authenticated key")
        fields = meta if isinstance(meta, dict) else {}
        try:
            self._check_clock(fields.get("time"), "the caller's")
            public_key = fields.get("public_key")
            if not isinstance(public_key, bytes) or len(public_key) != 32:
                raise Unauthenticated("a greeting names the caller's 32-byte public key")
            if curve_public_key(public_key).hex() != user_id:
                raise Unauthenticated("the greeting's key is not the key this connection was made with")
            credential = fields.get("credential")
            if credential is None and public_key != self.verifier.authorizer_key:
                if not anonymous_ok:
                    raise Unauthenticated(
                        "no credential: this node serves credentialed nodes of the run only"
                    )
            else:
                try:
                    self._callers[user_id] = self.verifier.identify(public_key, credential)
                except CredentialError as exc:
                    raise Unauthenticated(f"credential refused ({exc.reason}): {exc}") from None
        except Unauthenticated as exc:
            if len(self._refused) >= REFUSED_KEYS:
                self.forget_refusals()  # those refused long enough ago
            self._refused[bytes.fromhex(user_id)] = world.monotonic() + self.refused_for_s
            log.info("peer_refused", key=user_id[:16], reason=str(exc))
            raise
        return self.hello()

    def _check_clock(self, their_time: Any, whose: str) -> None:
        if (
            isinstance(their_time, bool)
            or not isinstance(their_time, (int, float))
            or their_time != their_time
        ):
            raise Unauthenticated("a greeting carries the sender's wall-clock time")
        skew = their_time - self.clock()
        if abs(skew) > self.max_clock_skew_s:
            raise Unauthenticated(
                f"{whose} clock is {skew:+.1f} s off this node's, beyond the run's limit of "
                f"{self.max_clock_skew_s:g} s: synchronize the clocks (NTP)"
            )

    # --- the client side --------------------------------------------------------------------------

    def hello(self) -> dict:
        """What this node presents on a connection (either end)."""
        return {"public_key": self.key.public_key, "credential": self.credential(), "time": self.clock()}

    def expect(self, address: str, public_key: bytes, *, credentialed: bool = True) -> None:
        """The node at ``address`` holds ``public_key`` (and, unless ``credentialed`` is False —
        a joiner the authorizer dials back — a credential of the run)."""
        self._expected[normalize_address(address)] = (public_key, credentialed)

    def forget(self, address: str) -> None:
        self._expected.pop(normalize_address(address), None)

    def add_resolver(self, resolver: Resolver) -> None:
        """Another source of address -> key (the DHT's member table)."""
        self._resolvers.append(resolver)

    def server_key(self, address: str) -> tuple[bytes, bool]:
        """The key expected at ``address``; PeerRefused when no source knows one."""
        address = normalize_address(address)
        known = self._expected.get(address)
        if known is not None:
            return known
        for resolver in self._resolvers:
            key = resolver(address)
            if key is not None:
                return key, True
        raise PeerRefused(
            f"no public key is known for {address}: it is not a member of this run's DHT "
            "(a bootstrap address names its node's key: <hex key>@host:port)"
        )

    def check_server(self, meta: Any, public_key: bytes, credentialed: bool) -> PeerIdentity | None:
        """The server's identity from its answer to our greeting (the handshake proved it holds
        ``public_key``); PeerRefused when its credential or clock does not hold up."""
        fields = meta if isinstance(meta, dict) else {}
        try:
            self._check_clock(fields.get("time"), "the server's")
        except Unauthenticated as exc:
            raise PeerRefused(str(exc)) from None
        credential = fields.get("credential")
        if credential is None and not credentialed and public_key != self.verifier.authorizer_key:
            return None
        try:
            return self.verifier.identify(public_key, credential)
        except CredentialError as exc:
            raise PeerRefused(f"the node holds no valid credential ({exc.reason}): {exc}") from None

    # --- changes -----------------------------------------------------------------------------------

    def on_credential_changed(self, listener: Callable[[], None]) -> None:
        self._credential_listeners.append(listener)

    def credential_changed(self) -> None:
        """This node's credential was refreshed: present it again on every connection."""
        for listener in self._credential_listeners:
            listener()

    def on_revocations(self, listener: Callable[[Revocations], None]) -> None:
        self._revocation_listeners.append(listener)

    def _revoked(self, revocations: Revocations) -> None:
        for user_id, identity in list(self._callers.items()):
            if self.verifier.revoked(identity):
                del self._callers[user_id]
                self._refused[bytes.fromhex(user_id)] = math.inf
                log.info("peer_revoked", node=identity.node_id[:12])
        for listener in self._revocation_listeners:
            listener(revocations)

    def forget_refusals(self, now: float | None = None) -> None:
        """Drop the refused keys whose refusal has run out (revoked ones stay)."""
        now = world.monotonic() if now is None else now
        for key, until in list(self._refused.items()):
            if until < now:
                del self._refused[key]
