"""DHT records: key -> {subkey -> (value, expiration, owner, signature)}.

Values are msgpack bytes, at most ``max_value_bytes``. Expirations are wall-clock seconds
(``time.time()``); the newest expiration wins and an expired record is invisible. A record
whose value is ``None`` is a tombstone: it hides older copies of a deleted subkey until they
have expired too.

A subkey that starts with ``@`` followed by a hex Ed25519 public key is **owned** by that key:
every replica accepts a write to it only when the record is signed with that key, over the
key, subkey, value and expiration. Other subkeys are open to any writer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from agora_core.errors import AgoraError
from agora_core.identity import NodeKey, verify_signature

OWNED_PREFIX = "@"
PUBLIC_KEY_HEX = 64
MAX_KEY_CHARS = 256
MAX_SUBKEY_CHARS = 256
SIGNATURE_CONTEXT = b"agora-dht-record-v1"


class DhtError(AgoraError):
    """A DHT operation could not be carried out."""


class RecordRejected(DhtError):
    """A replica refused a record: bad signature, wrong owner, limits, expiry bounds, schema."""


def owned_subkey(public_key: bytes, name: str = "") -> str:
    """The subkey only ``public_key``'s holder may write: ``@<hex key>`` or ``@<hex key>/name``."""
    return OWNED_PREFIX + public_key.hex() + (f"/{name}" if name else "")


def subkey_owner(subkey: str) -> bytes | None:
    """The public key that owns ``subkey``, or None for an open subkey."""
    if not subkey.startswith(OWNED_PREFIX):
        return None
    hex_key = subkey[1 : 1 + PUBLIC_KEY_HEX]
    rest = subkey[1 + PUBLIC_KEY_HEX :]
    if len(hex_key) != PUBLIC_KEY_HEX or (rest and not rest.startswith("/")):
        raise RecordRejected(f"owned subkey {subkey[:80]!r} must be @<64 hex digits>[/name]")
    try:
        return bytes.fromhex(hex_key)
    except ValueError:
        raise RecordRejected(f"owned subkey {subkey[:80]!r} has a malformed public key") from None


@dataclass(frozen=True, slots=True)
class Record:
    value: bytes | None  # msgpack bytes; None marks a tombstone
    expiration: float  # wall-clock seconds
    signature: bytes | None = None  # over signing_payload(); required for owned subkeys

    @property
    def is_tombstone(self) -> bool:
        return self.value is None

    def decoded(self) -> Any:
        return None if self.value is None else msgpack.unpackb(self.value, raw=False)

    def to_wire(self) -> list:
        return [self.value, self.expiration, self.signature]

    @classmethod
    def from_wire(cls, raw: Any) -> Record:
        """Parse the wire form strictly; RecordRejected for anything malformed."""
        if not isinstance(raw, list) or len(raw) != 3:
            raise RecordRejected("a record is [value, expiration, signature]")
        value, expiration, signature = raw
        if value is not None and not isinstance(value, bytes):
            raise RecordRejected("record value must be bytes or nil")
        if (
            isinstance(expiration, bool)
            or not isinstance(expiration, (int, float))
            or expiration != expiration
        ):
            raise RecordRejected("record expiration must be a number")
        if signature is not None and (not isinstance(signature, bytes) or len(signature) != 64):
            raise RecordRejected("record signature must be 64 bytes or nil")
        return cls(value, float(expiration), signature)


def signing_payload(key: str, subkey: str, value: bytes | None, expiration: float) -> bytes:
    return msgpack.packb([SIGNATURE_CONTEXT, key, subkey, value, expiration], use_bin_type=True)


def make_record(
    key: str,
    subkey: str,
    value: Any,
    expiration: float,
    *,
    signer: NodeKey | None = None,
    tombstone: bool = False,
) -> Record:
    """Encode ``value`` and, for owned subkeys, sign the record with ``signer``."""
    packed = None if tombstone else msgpack.packb(value, use_bin_type=True)
    owner = subkey_owner(subkey)
    signature = None
    if owner is not None:
        if signer is None or signer.public_key != owner:
            raise RecordRejected(f"subkey {subkey[:80]!r} is owned: sign it with the owner's key")
        signature = signer.sign(signing_payload(key, subkey, packed, expiration))
    return Record(packed, float(expiration), signature)


def check_ownership(key: str, subkey: str, record: Record) -> None:
    """Reject a write to an owned subkey that its owner did not sign."""
    owner = subkey_owner(subkey)
    if owner is None:
        return
    if record.signature is None:
        raise RecordRejected(f"unsigned write to owned subkey {subkey[:80]!r}")
    if not verify_signature(
        owner, signing_payload(key, subkey, record.value, record.expiration), record.signature
    ):
        raise RecordRejected(f"signature on {key!r}/{subkey[:80]!r} does not verify with its owner's key")
