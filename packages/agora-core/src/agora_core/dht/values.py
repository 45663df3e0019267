"""What a DHT get returns: the visible (unexpired, not deleted) subkeys of a key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agora_core.dht.records import Record, subkey_owner


@dataclass(frozen=True, slots=True)
class DhtValue:
    """What a get returns for one subkey."""

    value: Any
    expiration: float  # wall-clock seconds
    owner: bytes | None  # public key of an owned subkey's writer
    writer: bytes | None = None  # public key of whoever signed the record (None: unsigned)


def visible(records: dict[str, Record]) -> dict[str, DhtValue]:
    """The subkeys a reader sees: every record but the tombstones, decoded."""
    return {
        subkey: DhtValue(record.decoded(), record.expiration, subkey_owner(subkey), record.writer)
        for subkey, record in records.items()
        if not record.is_tombstone
    }
