"""A node's ZeroMQ CURVE key pair, derived from its Ed25519 identity key.

CURVE speaks X25519; an Ed25519 key converts to one (libsodium's birational map), so a
node has one identity and nothing more to keep: whoever knows a node's Ed25519 public key
knows the CURVE server key to dial it with, and a CURVE handshake that succeeds proves the
other side holds that node's secret key.
"""

from __future__ import annotations

import functools

import nacl.bindings

from agora_core.identity import NodeKey


@functools.lru_cache(maxsize=8192)  # asked per connection and per greeting: the same few keys
def curve_public_key(ed25519_public_key: bytes) -> bytes:
    """The 32-byte X25519 public key of an Ed25519 public key."""
    return nacl.bindings.crypto_sign_ed25519_pk_to_curve25519(ed25519_public_key)


def curve_keypair(key: NodeKey) -> tuple[bytes, bytes]:
    """``(public, secret)``: the node's 32-byte X25519 keys."""
    secret = nacl.bindings.crypto_sign_ed25519_sk_to_curve25519(key.secret_key_bytes())
    return curve_public_key(key.public_key), secret
