"""The revocation list: node ids and accounts the authorizer banned, published in the DHT.

One entry under ``<run>/revocations``, in the subkey owned by the authorizer's key (the key
the run config names), so only the authorizer can write it: :func:`check_revocations` is
the validator every replica runs on it. Nodes read it to drop banned peers within one
refresh period instead of waiting for those peers' credentials to expire. Entries only need
to outlive the banned node's last credential, so the list stays short.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agora_core.dht.records import RecordRejected, owned_subkey, subkey_owner

MAX_ENTRIES = 4096


def revocations_key(run_name: str) -> str:
    return f"{run_name}/revocations"


@dataclass(frozen=True, kw_only=True)
class Revocations:
    nodes: tuple[str, ...] = field(default=())  # node ids
    accounts: tuple[str, ...] = field(default=())
    updated: float = 0.0  # wall-clock seconds the authorizer wrote it

    def to_value(self) -> dict:
        return {"nodes": list(self.nodes), "accounts": list(self.accounts), "updated": self.updated}

    @classmethod
    def from_value(cls, value: Any) -> Revocations:
        if not isinstance(value, dict):
            raise RecordRejected("a revocation list must be a map")
        nodes, accounts, updated = value.get("nodes"), value.get("accounts"), value.get("updated")
        for name, items in (("nodes", nodes), ("accounts", accounts)):
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise RecordRejected(f"revocations.{name} must be a list of strings")
        if len(nodes) + len(accounts) > MAX_ENTRIES:
            raise RecordRejected(f"a revocation list holds at most {MAX_ENTRIES} entries")
        if not isinstance(updated, (int, float)) or isinstance(updated, bool):
            raise RecordRejected("revocations.updated must be a number")
        return cls(nodes=tuple(nodes), accounts=tuple(accounts), updated=float(updated))

    def revokes(self, node_id: str, account: str | None = None) -> bool:
        return node_id in self.nodes or (account is not None and account in self.accounts)


def check_revocations(authorizer_public_key: bytes | None):
    """The DHT validator of the revocations key: the authorizer's own subkey, a valid list."""

    def check(key: str, subkey: str, value: Any) -> None:
        if authorizer_public_key is None or subkey_owner(subkey) != authorizer_public_key:
            raise RecordRejected("only the run's authorizer may write its revocation list")
        if value is not None:
            Revocations.from_value(value)

    return check


def parse_revocations(values: Mapping[str, Any], authorizer_key: bytes) -> Revocations | None:
    """The revocation list among the entries under ``<run>/revocations``: the one in the
    authorizer's own subkey (None when there is none, or it is malformed)."""
    entry = values.get(owned_subkey(authorizer_key))
    if entry is None or entry.owner != authorizer_key:
        return None
    try:
        return Revocations.from_value(entry.value)
    except RecordRejected:
        return None
