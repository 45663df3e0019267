"""What the authorizer answers a joiner, and what it holds in memory about a queued request."""

from __future__ import annotations

from dataclasses import dataclass

from agora_authorizer.queue import AdmissionQueue
from agora_authorizer.store import IssuedCredential
from agora_core.admission import JoinRequest


@dataclass(frozen=True, kw_only=True)
class Waiting:
    """A queued request: what its credential will name."""

    node_id: str
    public_key: bytes
    role: str
    stage: int | None
    account: str
    checks: dict | None = None  # its measurements, stored when it is admitted


def request_fields(opened: JoinRequest) -> dict:
    return {
        "node_id": opened.node_id,
        "public_key": opened.public_key,
        "role": opened.role,
        "address": opened.address,
        "account": opened.account,
        "hardware": opened.hardware.to_value(),
        "software": opened.software,
    }


def admitted_answer(request_id: int, issued: IssuedCredential) -> dict:
    credential = {"body": issued.body, "signature": issued.signature}
    return {"status": "admitted", "request_id": request_id, "stage": issued.stage, "credential": credential}


def queued_answer(queue: AdmissionQueue, request_id: int, stage: int | None) -> dict:
    """A queued request's answer: its place, the estimated wait, when to ask again."""
    position = queue.position(request_id) or 1
    eta = queue.eta_s(position)
    return {
        "status": "queued",
        "request_id": request_id,
        "stage": stage,
        "position": position,
        "eta_s": eta,
        "poll_s": min(max(0.2, eta / 4), 10.0),
    }
