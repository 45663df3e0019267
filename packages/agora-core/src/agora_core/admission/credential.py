"""The credential: the authorizer's signed statement that a node key was admitted to a run.

``{run, node id, public key, role, stage, flags, issued, expires, serial, account}``, signed with the
authorizer's Ed25519 key, whose public half the run config names
(``[admission] authorizer_public_key``). It is short-lived (``credential_lifetime_s``, 10
minutes by default): a node refreshes it at two thirds of its life, and revocation is the
authorizer declining to. Any node checks one locally with :func:`verify_credential`; nothing
waits on the authorizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from agora_core import world
from agora_core.admission.signed import SignedMessage, decode_map, sign_map, verified_map
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey, node_id_from_public_key

CONTEXT = b"agora-credential-v1"
# dht: a seed of the run's DHT; operator: tools that run the run (both issued by the operator
# with ``agora-authorizer credential``, not through the join queue)
ROLES = ("worker", "trainer", "monitor", "dht", "operator")
REFRESH_AT = 2.0 / 3.0  # of a credential's lifetime


class CredentialError(AgoraError):
    """A credential is forged, malformed, expired, not yet valid, or for another run/node.

    ``reason`` is one of: malformed, bad_signature, other_run, expired, not_yet_valid,
    wrong_key.
    """

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


@dataclass(frozen=True, kw_only=True)
class Credential:
    run: str
    node_id: str
    public_key: bytes
    role: str  # worker, trainer, monitor
    stage: int | None  # a worker's stage; None for other roles
    issued: float  # wall-clock seconds
    expires: float
    serial: int  # unique per authorizer: refreshes and revocations name it
    flags: tuple[str, ...] = field(default=())
    account: str = ""  # whose node it is: a banned account's peers are dropped by everyone

    @property
    def lifetime_s(self) -> float:
        return self.expires - self.issued

    @property
    def refresh_at(self) -> float:
        """When its holder should ask for the next one (two thirds into its life)."""
        return self.issued + REFRESH_AT * self.lifetime_s

    def remaining_s(self, now: float | None = None) -> float:
        return self.expires - (world.wall() if now is None else now)

    def to_fields(self) -> dict:
        fields = asdict(self)
        fields["flags"] = list(self.flags)
        return fields


@dataclass(frozen=True, slots=True)
class SignedCredential:
    credential: Credential
    message: SignedMessage

    def to_value(self) -> dict:
        return self.message.to_value()


def issue_credential(authorizer: NodeKey, credential: Credential) -> SignedCredential:
    return SignedCredential(credential, sign_map(authorizer, CONTEXT, credential.to_fields()))


def _parse(fields: dict) -> Credential:
    kinds = {"run": str, "node_id": str, "public_key": bytes, "role": str, "serial": int}
    for name, kind in kinds.items():
        if not isinstance(fields.get(name), kind) or isinstance(fields.get(name), bool):
            raise CredentialError("malformed", f"credential field {name!r} is missing or not {kind.__name__}")
    for name in ("issued", "expires"):
        if not isinstance(fields.get(name), (int, float)) or isinstance(fields.get(name), bool):
            raise CredentialError("malformed", f"credential field {name!r} is missing or not a number")
    stage = fields.get("stage")
    if stage is not None and (not isinstance(stage, int) or isinstance(stage, bool) or stage < 0):
        raise CredentialError("malformed", "credential field 'stage' must be a non-negative int or nil")
    flags = fields.get("flags", [])
    if not isinstance(flags, list) or not all(isinstance(f, str) for f in flags):
        raise CredentialError("malformed", "credential field 'flags' must be a list of strings")
    account = fields.get("account", "")
    if not isinstance(account, str):
        raise CredentialError("malformed", "credential field 'account' must be a string")
    if fields["role"] not in ROLES:
        raise CredentialError("malformed", f"credential role {fields['role']!r} is not one of {ROLES}")
    if node_id_from_public_key(fields["public_key"]) != fields["node_id"]:
        raise CredentialError("malformed", "credential node id is not derived from its public key")
    return Credential(
        run=fields["run"],
        node_id=fields["node_id"],
        public_key=fields["public_key"],
        role=fields["role"],
        stage=stage,
        issued=float(fields["issued"]),
        expires=float(fields["expires"]),
        serial=fields["serial"],
        flags=tuple(flags),
        account=account,
    )


def verify_credential(
    value: Any,
    *,
    authorizer_public_key: bytes,
    run: str,
    now: float | None = None,
    max_clock_skew_s: float = 5.0,
    public_key: bytes | None = None,
) -> SignedCredential:
    """The credential in ``value`` (a received map) after checking it was signed by the
    run's authorizer, names run ``run`` (and ``public_key`` when given) and is valid at
    ``now`` give or take ``max_clock_skew_s``. Raises :class:`CredentialError` with the reason."""
    message = SignedMessage.from_value(value)
    if message is None:
        raise CredentialError("malformed", "not a signed credential ({body: bytes, signature: 64 bytes})")
    if not verified_map(message, CONTEXT, authorizer_public_key):
        raise CredentialError("bad_signature", "the credential is not signed by this run's authorizer")
    fields = decode_map(message)
    if fields is None:
        raise CredentialError("malformed", "the credential body is not a map")
    credential = _parse(fields)
    if credential.run != run:
        raise CredentialError("other_run", f"the credential is for run {credential.run!r}, not {run!r}")
    if public_key is not None and credential.public_key != public_key:
        raise CredentialError("wrong_key", "the credential was issued to another key")
    now = world.wall() if now is None else now
    if now > credential.expires + max_clock_skew_s:
        raise CredentialError("expired", f"the credential expired {now - credential.expires:.0f} s ago")
    if now < credential.issued - max_clock_skew_s:
        raise CredentialError("not_yet_valid", "the credential was issued in the future")
    return SignedCredential(credential, message)
