"""The join request a worker or trainer signs and sends the authorizer, and the refresh
request that renews its credential.

Both are signed by the node's own key, carry a wall-clock timestamp and a random nonce: the
authorizer refuses one whose timestamp is too far from its clock (stale) or whose nonce it
has seen (replayed). The node id must be the hash of the public key the request names.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from agora_core import world
from agora_core.admission.refusals import Refusal, RefusalReason
from agora_core.admission.signed import SignedMessage, decode_map, sign_map, verified_map
from agora_core.identity import NodeKey, node_id_from_public_key

JOIN_CONTEXT = b"agora-join-request-v1"
REFRESH_CONTEXT = b"agora-refresh-request-v1"
NONCE_BYTES = 16
JOIN_ROLES = ("worker", "trainer", "monitor")


@dataclass(frozen=True, kw_only=True)
class HardwareReport:
    """What a node says it has; the authorizer checks it against the run's minimums and
    proves the compute part with the challenge."""

    device: str  # "cpu", "cuda"
    device_name: str = ""  # e.g. "NVIDIA GeForce RTX 4090"
    device_memory_bytes: int = 0
    host_memory_bytes: int = 0
    cpu_count: int = 0

    def to_value(self) -> dict:
        return asdict(self)

    @classmethod
    def from_value(cls, value: Any) -> HardwareReport | None:
        if not isinstance(value, dict) or not isinstance(value.get("device"), str):
            return None
        ints = ("device_memory_bytes", "host_memory_bytes", "cpu_count")
        if any(not isinstance(value.get(n, 0), int) or value.get(n, 0) < 0 for n in ints):
            return None
        if not isinstance(value.get("device_name", ""), str):
            return None
        return cls(
            device=value["device"],
            device_name=value.get("device_name", ""),
            **{n: value.get(n, 0) for n in ints},
        )


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    run: str
    node_id: str
    public_key: bytes
    role: str  # worker, trainer, monitor
    address: str  # where the authorizer dials back (the node's RPC port)
    account: str
    account_token: str = field(repr=False)  # a secret: never in logs
    hardware: HardwareReport
    software: dict[str, dict[str, str]]  # package -> {version, digest} (agora_core.admission.software)
    timestamp: float = field(default_factory=lambda: world.wall())
    nonce: bytes = field(default_factory=lambda: world.token_bytes(NONCE_BYTES))

    def to_fields(self) -> dict:
        fields = asdict(self)
        fields["hardware"] = self.hardware.to_value()
        return fields


def sign_join_request(key: NodeKey, request: JoinRequest) -> SignedMessage:
    return sign_map(key, JOIN_CONTEXT, request.to_fields())


def _freshness(timestamp: float, now: float, max_age_s: float) -> Refusal | None:
    if not math.isfinite(timestamp) or abs(now - timestamp) > max_age_s:  # NaN compares false
        return Refusal(
            RefusalReason.STALE,
            f"the request is {now - timestamp:+.0f} s off the authorizer's clock (at most {max_age_s:g} s): "
            "check the node's clock and send a fresh request",
        )
    return None


def open_join_request(value: Any, *, run: str, now: float, max_age_s: float) -> JoinRequest | Refusal:
    """The request in ``value`` once its signature, run and timestamp check out, or why not.
    (Replays are the authorizer's to catch: it remembers nonces.)"""
    message = SignedMessage.from_value(value)
    fields = decode_map(message) if message is not None else None
    if fields is None:
        return Refusal(RefusalReason.MALFORMED, "not a signed join request ({body, signature})")
    strings = ("run", "node_id", "role", "address", "account", "account_token")
    if any(not isinstance(fields.get(n), str) for n in strings):
        return Refusal(RefusalReason.MALFORMED, f"a join request needs string fields {', '.join(strings)}")
    public_key, nonce = fields.get("public_key"), fields.get("nonce")
    if not isinstance(public_key, bytes) or len(public_key) != 32:
        return Refusal(RefusalReason.MALFORMED, "public_key must be 32 bytes")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        return Refusal(RefusalReason.MALFORMED, f"nonce must be {NONCE_BYTES} bytes")
    timestamp = fields.get("timestamp")
    if not isinstance(timestamp, (int, float)) or isinstance(timestamp, bool):
        return Refusal(RefusalReason.MALFORMED, "timestamp must be a number")
    hardware = HardwareReport.from_value(fields.get("hardware"))
    software = fields.get("software")
    if hardware is None:
        return Refusal(RefusalReason.MALFORMED, "hardware must be a hardware report")
    if not isinstance(software, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("version"), str) and isinstance(v.get("digest"), str)
        for v in software.values()
    ):
        return Refusal(RefusalReason.MALFORMED, "software must map package names to {version, digest}")
    if fields["role"] not in JOIN_ROLES:
        return Refusal(RefusalReason.MALFORMED, f"role must be one of {JOIN_ROLES}")
    if node_id_from_public_key(public_key) != fields["node_id"] or not verified_map(
        message, JOIN_CONTEXT, public_key
    ):
        return Refusal(RefusalReason.BAD_SIGNATURE, "the request is not signed by the key it names")
    if fields["run"] != run:
        return Refusal(
            RefusalReason.OTHER_RUN, f"this authorizer admits to run {run!r}, not {fields['run']!r}"
        )
    stale = _freshness(float(timestamp), now, max_age_s)
    if stale is not None:
        return stale
    return JoinRequest(
        run=fields["run"],
        node_id=fields["node_id"],
        public_key=public_key,
        role=fields["role"],
        address=fields["address"],
        account=fields["account"],
        account_token=fields["account_token"],
        hardware=hardware,
        software={name: {"version": v["version"], "digest": v["digest"]} for name, v in software.items()},
        timestamp=float(timestamp),
        nonce=nonce,
    )


@dataclass(frozen=True, kw_only=True)
class RefreshRequest:
    """Renew credential ``serial``: signed by the key it was issued to."""

    run: str
    node_id: str
    serial: int
    timestamp: float = field(default_factory=lambda: world.wall())
    nonce: bytes = field(default_factory=lambda: world.token_bytes(NONCE_BYTES))

    def to_fields(self) -> dict:
        return asdict(self)


def sign_refresh_request(key: NodeKey, request: RefreshRequest) -> SignedMessage:
    return sign_map(key, REFRESH_CONTEXT, request.to_fields())


def open_refresh_request(
    value: Any, *, public_key_of: Any, run: str, now: float, max_age_s: float
) -> RefreshRequest | Refusal:
    """The refresh request in ``value`` once signed by the key its credential was issued to
    (``public_key_of(serial)``: the stored key, or None for a serial never issued)."""
    message = SignedMessage.from_value(value)
    fields = decode_map(message) if message is not None else None
    if fields is None:
        return Refusal(RefusalReason.MALFORMED, "not a signed refresh request ({body, signature})")
    serial, timestamp, nonce = fields.get("serial"), fields.get("timestamp"), fields.get("nonce")
    if not isinstance(serial, int) or isinstance(serial, bool) or not isinstance(fields.get("run"), str):
        return Refusal(RefusalReason.MALFORMED, "a refresh request needs run and serial")
    if not isinstance(timestamp, (int, float)) or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        return Refusal(RefusalReason.MALFORMED, "a refresh request needs a timestamp and a nonce")
    if not isinstance(fields.get("node_id"), str):
        return Refusal(RefusalReason.MALFORMED, "a refresh request needs node_id")
    public_key = public_key_of(serial)
    if public_key is None:
        return Refusal(RefusalReason.UNKNOWN_CREDENTIAL, f"no credential with serial {serial} was issued")
    if node_id_from_public_key(public_key) != fields["node_id"] or not verified_map(
        message, REFRESH_CONTEXT, public_key
    ):
        return Refusal(RefusalReason.BAD_SIGNATURE, "the refresh is not signed by the credential's key")
    if fields["run"] != run:
        return Refusal(RefusalReason.OTHER_RUN, f"this authorizer serves run {run!r}, not {fields['run']!r}")
    stale = _freshness(float(timestamp), now, max_age_s)
    if stale is not None:
        return stale
    return RefreshRequest(
        run=fields["run"], node_id=fields["node_id"], serial=serial, timestamp=float(timestamp), nonce=nonce
    )
