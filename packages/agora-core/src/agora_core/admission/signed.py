"""Signed messages: msgpack bytes plus an Ed25519 signature over them and a context tag.

The receiver verifies the exact bytes it received and only then decodes them, so no
canonical re-encoding is needed; the context tag keeps a signature made for one kind of
message (a credential) from being accepted as another (a join request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from agora_core.identity import NodeKey, verify_signature

MAX_SIGNED_BYTES = 64 * 1024  # a join request with its reports is a few KiB


@dataclass(frozen=True, slots=True)
class SignedMessage:
    body: bytes  # msgpack of a map
    signature: bytes  # Ed25519 over context + body

    def to_value(self) -> dict:
        return {"body": self.body, "signature": self.signature}

    @classmethod
    def from_value(cls, value: Any) -> SignedMessage | None:
        """The message in a received map, or None when it is not one."""
        if not isinstance(value, dict):
            return None
        body, signature = value.get("body"), value.get("signature")
        if not isinstance(body, bytes) or not isinstance(signature, bytes) or len(signature) != 64:
            return None
        if len(body) > MAX_SIGNED_BYTES:
            return None
        return cls(body, signature)


def sign_map(key: NodeKey, context: bytes, fields: dict) -> SignedMessage:
    body = msgpack.packb(fields, use_bin_type=True)
    return SignedMessage(body, key.sign(context + b"\0" + body))


def verified_map(message: SignedMessage, context: bytes, public_key: bytes) -> bool:
    return verify_signature(public_key, context + b"\0" + message.body, message.signature)


def decode_map(message: SignedMessage) -> dict | None:
    """The body as a map with string keys, or None when it is not one."""
    try:
        value = msgpack.unpackb(message.body, raw=False, strict_map_key=True)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    return value
