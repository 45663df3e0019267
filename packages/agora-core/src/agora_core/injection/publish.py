"""The operator's side: write injection records into a run's DHT, list them, clear them.

``tools/inject.py`` and the benchmarks use these; they need a DHT member of the run (a
``RunNode`` with the operator's key, and in an authorized run its operator credential) and
nothing else: no process, file or address of the nodes they aim at.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agora_core import world
from agora_core.dht import DhtError, DhtNode
from agora_core.identity import NodeKey
from agora_core.injection.record import (
    Action,
    Injection,
    InjectionRejected,
    Targets,
    Trigger,
    injections_key,
    record_subkey,
)

DEFAULT_TTL_S = 60.0  # a record lives this long after it is due: long enough to be read, then gone
RETRY_S = 10.0  # how long a write is retried while replicas refuse it
RETRY_EVERY_S = 0.2


def new_injection(
    *,
    trigger: Trigger | str,
    action: Action | str,
    targets: Targets | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    record_id: str | None = None,
    credential: Any = None,
    **params: Any,
) -> Injection:
    """An injection issued now, expiring ``ttl_s`` after it is due (``after_s`` later for an
    ``after`` trigger); ``params``: after_s, at_chunk, factor, duration_s, exit_code."""
    if ttl_s <= 0:
        raise InjectionRejected("malformed", "ttl_s must be positive")
    issued = world.wall()
    due = issued + (float(params.get("after_s", 0.0)) if Trigger(trigger) is Trigger.AFTER else 0.0)
    return Injection(
        id=record_id or f"inj-{int(issued)}-{secrets.token_hex(3)}",
        issued=issued,
        expires=due + ttl_s,
        trigger=Trigger(trigger),
        action=Action(action),
        targets=targets or Targets(),
        credential=credential,
        **params,
    )


async def retrying(write: Callable[[], Awaitable[int]], timeout_s: float) -> int:
    """``write()`` until no replica refuses it. In an authorized run a replica takes records
    only from members it knows, and a tool that just joined is known to every replica a
    gossip period or two later; until then a write is refused (RecordRejected, a DhtError)."""
    deadline = world.monotonic() + timeout_s
    while True:
        try:
            return await write()
        except DhtError:
            if world.monotonic() > deadline:
                raise
            await asyncio.sleep(RETRY_EVERY_S)


async def publish(
    dht: DhtNode, key: NodeKey, run_name: str, injection: Injection, *, timeout_s: float = RETRY_S
) -> int:
    """Store ``injection`` under ``key``'s own subkey for it; returns the replicas that took it."""
    return await retrying(
        lambda: dht.store(
            injections_key(run_name),
            record_subkey(key.public_key, injection.id),
            injection.to_value(),
            injection.expires,
            signer=key,
        ),
        timeout_s,
    )


@dataclass(frozen=True)
class Listed:
    subkey: str
    writer: bytes | None
    expiration: float
    injection: Injection | None  # None: not a record this version can read
    problem: str = ""


async def list_injections(dht: DhtNode, run_name: str) -> list[Listed]:
    """Every live record under the run's injection key, readable or not, oldest first."""
    found = await dht.get(injections_key(run_name))
    listed = []
    for subkey, value in found.items():
        try:
            listed.append(Listed(subkey, value.writer, value.expiration, Injection.from_value(value.value)))
        except InjectionRejected as exc:
            listed.append(Listed(subkey, value.writer, value.expiration, None, f"{exc.reason}: {exc}"))
    return sorted(listed, key=lambda item: item.injection.issued if item.injection else 0.0)


async def clear(dht: DhtNode, key: NodeKey, run_name: str, record_ids: list[str] | None = None) -> list[str]:
    """Delete ``key``'s own records (those named, or all of them); returns the ids deleted.
    A node that armed a record before it was deleted may still obey it: clearing stops the
    records nobody has read yet, and those about joiners."""
    mine = [item for item in await list_injections(dht, run_name) if item.writer == key.public_key]
    deleted = []
    for item in mine:
        record_id = item.subkey.rsplit("/", 1)[-1]
        if record_ids is None or record_id in record_ids:
            await retrying(
                lambda subkey=item.subkey: dht.delete(injections_key(run_name), subkey, signer=key), RETRY_S
            )
            deleted.append(record_id)
    return deleted
