"""DHT records: key -> {subkey -> (value, expiration, signature, writer)}.

Values are msgpack bytes, at most ``max_value_bytes``. Expirations are wall-clock seconds
(``world.wall()``); the newest expiration wins and an expired record is invisible. A record
whose value is ``None`` is a tombstone: it hides older copies of a deleted subkey until they
have expired too.

A subkey that starts with ``@`` followed by a hex Ed25519 public key is **owned** by that key:
every replica accepts a write to it only when the record is signed with that key, over the
key, subkey, value and expiration. Other subkeys are open to any writer.

Every record a DhtNode writes is signed by its writer (the node's key, or the owner's for an
owned subkey) over key, subkey, value, expiration and the writer's public key, and names that
key, so any replica or reader can tell who wrote it. A replica checks the signature on every
receive path; an authorized run also refuses unsigned records and writers it does not know as
credentialed members (``RecordStore``'s writer policy). An open run may still accept unsigned
records under open subkeys.
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
SIGNATURE_CONTEXT = b"agora-dht-record-v2"


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
    signature: bytes | None = None  # the writer's, over signing_payload()
    writer: bytes | None = None  # the writer's Ed25519 public key (None: unsigned)

    @property
    def is_tombstone(self) -> bool:
        return self.value is None

    def decoded(self) -> Any:
        return None if self.value is None else msgpack.unpackb(self.value, raw=False)

    def to_wire(self) -> list:
        return [self.value, self.expiration, self.signature, self.writer]

    @classmethod
    def from_wire(cls, raw: Any) -> Record:
        """Parse the wire form strictly; RecordRejected for anything malformed."""
        if not isinstance(raw, list) or len(raw) != 4:
            raise RecordRejected("a record is [value, expiration, signature, writer]")
        value, expiration, signature, writer = raw
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
        if writer is not None and (not isinstance(writer, bytes) or len(writer) != 32):
            raise RecordRejected("record writer must be a 32-byte public key or nil")
        if (signature is None) != (writer is None):
            raise RecordRejected("a record has both a signature and its writer, or neither")
        return cls(value, float(expiration), signature, writer)


def signing_payload(key: str, subkey: str, value: bytes | None, expiration: float, writer: bytes) -> bytes:
    return msgpack.packb([SIGNATURE_CONTEXT, key, subkey, value, expiration, writer], use_bin_type=True)


def make_record(
    key: str,
    subkey: str,
    value: Any,
    expiration: float,
    *,
    signer: NodeKey | None = None,
    tombstone: bool = False,
) -> Record:
    """Encode ``value`` and sign the record with ``signer`` (required for owned subkeys,
    which only their owner may sign). Without a signer the record is unsigned."""
    packed = None if tombstone else msgpack.packb(value, use_bin_type=True)
    owner = subkey_owner(subkey)
    if owner is not None and (signer is None or signer.public_key != owner):
        raise RecordRejected(f"subkey {subkey[:80]!r} is owned: sign it with the owner's key")
    if signer is None:
        return Record(packed, float(expiration))
    expiration = float(expiration)
    writer = signer.public_key
    signature = signer.sign(signing_payload(key, subkey, packed, expiration, writer))
    return Record(packed, expiration, signature, writer)


def check_signature(key: str, subkey: str, record: Record) -> None:
    """Reject a record whose signature does not verify with the writer it names, and a write
    to an owned subkey that its owner did not sign. Unsigned open records pass (the store's
    writer policy decides about them)."""
    owner = subkey_owner(subkey)
    if record.signature is None or record.writer is None:
        if owner is not None:
            raise RecordRejected(f"unsigned write to owned subkey {subkey[:80]!r}")
        return
    if owner is not None and record.writer != owner:
        raise RecordRejected(f"subkey {subkey[:80]!r} is owned by another key than the record's writer")
    if not verify_signature(
        record.writer,
        signing_payload(key, subkey, record.value, record.expiration, record.writer),
        record.signature,
    ):
        raise RecordRejected(f"signature on {key!r}/{subkey[:80]!r} does not verify with its writer's key")
