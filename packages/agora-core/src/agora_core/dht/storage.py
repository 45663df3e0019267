"""One node's share of the DHT: records it holds as a replica, and the rules for accepting them.

Every record is checked on receive — key and value sizes, expiration bounds, the sender's
clock, the writer's signature (and, in an authorized run, whether the writer may write at
all), and the validators registered for its key prefix — before it is stored. Signatures this
store has verified are remembered (by their bytes), so the copies of one record arriving from
several replicas and repair paths cost one check. Among copies of one subkey the newest expiration wins (ties broken by value, so
every replica picks the same one).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agora_core.dht.records import MAX_KEY_CHARS, MAX_SUBKEY_CHARS, Record, RecordRejected, check_signature

Validator = Callable[[str, str, Any], None]  # (key, subkey, decoded value); raises RecordRejected
WriterPolicy = Callable[[bytes | None], None]  # (writer's public key or None); raises RecordRejected
VERIFIED_ENTRIES = 8192


class Validators:
    """Application checks per key prefix, e.g. a schema for ``stage/<s>/workers`` values."""

    def __init__(self) -> None:
        self._by_prefix: list[tuple[str, Validator]] = []

    def register(self, prefix: str, validator: Validator) -> None:
        self._by_prefix.append((prefix, validator))

    def check(self, key: str, subkey: str, record: Record) -> None:
        if record.is_tombstone:
            return
        matching = [validator for prefix, validator in self._by_prefix if key.startswith(prefix)]
        if not matching:
            return
        try:
            value = record.decoded()
        except Exception:
            raise RecordRejected(f"value of {key!r}/{subkey[:80]!r} is not valid msgpack") from None
        for validator in matching:
            try:
                validator(key, subkey, value)
            except RecordRejected:
                raise
            except Exception as exc:
                raise RecordRejected(f"{key!r}/{subkey[:80]!r} failed validation: {exc}") from None


@dataclass(kw_only=True, frozen=True)
class StoreLimits:
    max_value_bytes: int = 64 * 1024
    max_subkeys: int = 4096  # per key
    max_records: int = 1_000_000  # per node, all keys together
    max_expiration_ahead_s: float = 3600.0
    max_clock_skew_s: float = 30.0


def newer(new: Record, old: Record) -> bool:
    """Whether ``new`` replaces ``old``: later expiration, ties broken by value."""
    return (new.expiration, new.value or b"") > (old.expiration, old.value or b"")


class RecordStore:
    """Records this node holds. Owned by the node's event loop."""

    def __init__(
        self,
        limits: StoreLimits | None = None,
        validators: Validators | None = None,
        writers: WriterPolicy | None = None,
    ):
        """``writers``: who may write at all (an authorized run's members); default anyone."""
        self.limits = limits or StoreLimits()
        self.validators = validators or Validators()
        self.writers = writers or (lambda writer: None)
        self._verified: collections.OrderedDict[tuple, None] = collections.OrderedDict()
        self._data: dict[str, dict[str, Record]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def keys(self) -> list[str]:
        return list(self._data)

    def validate(self, key: Any, subkey: Any, record: Record, *, now: float, sender_now: Any = None) -> None:
        """Raise RecordRejected unless this node may accept ``record`` at ``now``."""
        limits = self.limits
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise RecordRejected(f"key must be a str of 1-{MAX_KEY_CHARS} characters")
        if not isinstance(subkey, str) or len(subkey) > MAX_SUBKEY_CHARS:
            raise RecordRejected(f"subkey must be a str of at most {MAX_SUBKEY_CHARS} characters")
        if record.value is not None and len(record.value) > limits.max_value_bytes:
            raise RecordRejected(
                f"value of {key!r} is {len(record.value)} bytes; the limit is {limits.max_value_bytes}"
            )
        if record.expiration > now + limits.max_expiration_ahead_s:
            raise RecordRejected(
                f"expiration {record.expiration - now:.0f} s ahead exceeds the limit of "
                f"{limits.max_expiration_ahead_s:.0f} s"
            )
        if sender_now is not None:
            if isinstance(sender_now, bool) or not isinstance(sender_now, (int, float)):
                raise RecordRejected("sender clock must be a number")
            if abs(sender_now - now) > limits.max_clock_skew_s:
                raise RecordRejected(
                    f"sender clock is {sender_now - now:+.1f} s off; the bound is {limits.max_clock_skew_s:.0f} s"
                )
        self.writers(record.writer)
        self._check_signature(key, subkey, record)
        self.validators.check(key, subkey, record)

    def _check_signature(self, key: str, subkey: str, record: Record) -> None:
        if record.signature is None:
            check_signature(key, subkey, record)  # owned subkeys need one
            return
        value_hash = hashlib.blake2b(record.value or b"", digest_size=16).digest()
        seen = (record.signature, record.writer, key, subkey, record.expiration, value_hash)
        if seen in self._verified:
            self._verified.move_to_end(seen)
            return
        check_signature(key, subkey, record)
        self._verified[seen] = None
        if len(self._verified) > VERIFIED_ENTRIES:
            self._verified.popitem(last=False)

    def put(self, key: str, subkey: str, record: Record, *, now: float) -> bool:
        """Keep ``record`` if it is newer than the copy held; returns whether it was kept."""
        if record.expiration <= now:
            return False
        subkeys = self._data.get(key)
        old = subkeys.get(subkey) if subkeys else None
        if old is not None:
            if old.expiration > now and not newer(record, old):
                return False
        else:
            if subkeys is not None and len(subkeys) >= self.limits.max_subkeys:
                self._purge_key(key, now)
                if len(subkeys) >= self.limits.max_subkeys:
                    raise RecordRejected(f"{key!r} already has {len(subkeys)} subkeys, the limit")
            if self._count >= self.limits.max_records:
                raise RecordRejected("this node holds its maximum number of records")
            self._count += 1
        self._data.setdefault(key, {})[subkey] = record
        return True

    def get(self, key: str, *, now: float) -> dict[str, Record]:
        """Unexpired records of ``key``, tombstones included (callers merge, then hide them)."""
        subkeys = self._data.get(key)
        if not subkeys:
            return {}
        return {subkey: record for subkey, record in subkeys.items() if record.expiration > now}

    def drop(self, key: str) -> None:
        """Forget a key this node is no longer a replica of (after handing it over)."""
        subkeys = self._data.pop(key, None)
        if subkeys:
            self._count -= len(subkeys)

    def _purge_key(self, key: str, now: float) -> int:
        subkeys = self._data.get(key, {})
        expired = [subkey for subkey, record in subkeys.items() if record.expiration <= now]
        for subkey in expired:
            del subkeys[subkey]
        self._count -= len(expired)
        if not subkeys:
            self._data.pop(key, None)
        return len(expired)

    def purge(self, now: float) -> int:
        """Remove expired records; returns how many."""
        return sum(self._purge_key(key, now) for key in list(self._data))
