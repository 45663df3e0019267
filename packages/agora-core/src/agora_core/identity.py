"""Node identity: an Ed25519 key pair kept in a private file, and the node id derived from it.

The key file is two lines: a format tag and the 32-byte private seed in hex. It is created
with mode 0600 and refused when group or others can read it, as ssh does.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import OrderedDict
from pathlib import Path

import nacl.exceptions
import nacl.signing

from agora_core.errors import AgoraError

KEY_FILE_TAG = "agora-ed25519-seed-v1"
NODE_ID_BYTES = 20  # 160-bit ids: the DHT's id space
VERIFIED_CACHE_SIZE = 8192  # signatures remembered as good (about 100 bytes each)


class IdentityError(AgoraError):
    """A key file is missing, malformed, or readable by others."""


def node_id_from_public_key(public_key: bytes) -> str:
    """Hex node id: BLAKE2b-160 of the raw Ed25519 public key."""
    return hashlib.blake2b(public_key, digest_size=NODE_ID_BYTES).hexdigest()


# Digests of (key, signature, message) triples that verified. A node checks the same signature
# again and again: a record read back on every poll, a member's claim in each copy of a member
# list. Hashing the triple costs about a microsecond, an Ed25519 check about sixty. Only good
# signatures are kept, so a flood of bad ones costs full checks and evicts nothing it chose.
_verified: OrderedDict[bytes, None] = OrderedDict()


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when ``signature`` is ``public_key``'s Ed25519 signature of ``message``."""
    if not (isinstance(public_key, bytes) and isinstance(message, bytes) and isinstance(signature, bytes)):
        return False
    digest = hashlib.blake2b(message, digest_size=32, key=public_key[:64]).digest() + signature
    if digest in _verified:
        _verified.move_to_end(digest)
        return True
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError):
        return False
    _verified[digest] = None
    while len(_verified) > VERIFIED_CACHE_SIZE:
        _verified.popitem(last=False)
    return True


class NodeKey:
    """A node's signing key. ``node_id`` and ``public_key`` are safe to share."""

    def __init__(self, signing_key: nacl.signing.SigningKey):
        self._signing_key = signing_key
        self.public_key: bytes = bytes(signing_key.verify_key)
        self.node_id: str = node_id_from_public_key(self.public_key)

    @classmethod
    def generate(cls) -> NodeKey:
        return cls(nacl.signing.SigningKey.generate())

    @classmethod
    def from_seed(cls, seed: bytes) -> NodeKey:
        return cls(nacl.signing.SigningKey(seed))

    def sign(self, message: bytes) -> bytes:
        """The 64-byte detached signature of ``message``."""
        return self._signing_key.sign(message).signature

    def secret_key_bytes(self) -> bytes:
        """libsodium's 64-byte secret key (seed + public key): for deriving the CURVE key."""
        return bytes(self._signing_key) + self.public_key

    def save(self, path: str | Path, *, overwrite: bool = False) -> Path:
        """Write the key file with mode 0600 (atomically; never clobbers unless asked)."""
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not overwrite:
            raise IdentityError(f"key file {path} already exists (pass overwrite to replace it)")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(f"{KEY_FILE_TAG}\n{bytes(self._signing_key).hex()}\n")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | Path) -> NodeKey:
        path = Path(path).expanduser()
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            raise IdentityError(f"key file {path} does not exist (create one: agora keygen)") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise IdentityError(
                f"key file {path} is accessible by group or others (mode {stat.S_IMODE(mode):o}); "
                f"run: chmod 600 {path}"
            )
        lines = path.read_text(encoding="ascii", errors="replace").split()
        if len(lines) != 2 or lines[0] != KEY_FILE_TAG:
            raise IdentityError(f"key file {path} is not an Agora key file ({KEY_FILE_TAG})")
        try:
            seed = bytes.fromhex(lines[1])
        except ValueError:
            raise IdentityError(f"key file {path}: the seed is not hex") from None
        if len(seed) != 32:
            raise IdentityError(f"key file {path}: the seed must be 32 bytes, got {len(seed)}")
        return cls.from_seed(seed)

    @classmethod
    def load_or_create(cls, path: str | Path) -> NodeKey:
        path = Path(path).expanduser()
        if path.exists():
            return cls.load(path)
        key = cls.generate()
        key.save(path)
        return key
