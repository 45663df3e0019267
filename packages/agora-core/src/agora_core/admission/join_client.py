"""A node's side of admission: send the join request, wait in the queue, take the credential.

:class:`Admission` submits one signed request and polls the authorizer until it is admitted
or refused; every answer is a :class:`JoinStatus`. A queued answer already names the stage
the node was placed on, so a worker can download that stage's state while it waits (the
report's overlap of queueing and download).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agora_core import world
from agora_core.admission.credential import CredentialError, SignedCredential, verify_credential
from agora_core.admission.join_request import JoinRequest, sign_join_request
from agora_core.contract import Method
from agora_core.errors import AgoraError, BadRequest
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient

JOIN_TIMEOUT_S = 120.0  # the authorizer dials back, times a probe and a challenge meanwhile
POLL_TIMEOUT_S = 10.0
STATUSES = ("queued", "admitted", "refused")


class AdmissionRefused(AgoraError):
    """The authorizer refused the node; ``reason`` is a RefusalReason value."""

    def __init__(self, reason: str, detail: str) -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"admission refused ({reason}): {detail}")


@dataclass(frozen=True, kw_only=True)
class JoinStatus:
    status: str  # queued, admitted, refused
    request_id: int | None = None
    position: int | None = None  # 1: next to be admitted
    eta_s: float | None = None  # the authorizer's estimate of the wait
    stage: int | None = None  # where the node serves (workers), known while queued
    poll_s: float = 1.0  # how soon to ask again
    credential: SignedCredential | None = None
    reason: str = ""
    detail: str = ""

    def describe(self) -> str:
        if self.status == "queued":
            eta = "" if self.eta_s is None else f", about {self.eta_s:.0f} s to wait"
            stage = "" if self.stage is None else f", placed on stage {self.stage}"
            return f"queued: position {self.position}{eta}{stage}"
        if self.status == "admitted":
            assert self.credential is not None
            left = self.credential.credential.remaining_s()
            stage = "" if self.stage is None else f" to stage {self.stage}"
            return f"admitted{stage}: credential {self.credential.credential.serial}, valid {left:.0f} s"
        return f"refused ({self.reason}): {self.detail}"


def parse_status(meta: Any, *, authorizer_key: bytes, run: str, public_key: bytes) -> JoinStatus:
    """A reply of admission.join/poll/refresh as a JoinStatus; an admitted one's credential
    is checked against the run's authorizer key and the node's own key."""
    if not isinstance(meta, dict) or meta.get("status") not in STATUSES:
        raise BadRequest(f"the authorizer answered something that is not a join status: {meta!r:.200}")
    status = meta["status"]
    credential = None
    if status == "admitted":
        try:
            credential = verify_credential(
                meta.get("credential"), authorizer_public_key=authorizer_key, run=run, public_key=public_key
            )
        except CredentialError as exc:
            raise AdmissionRefused(
                f"credential_{exc.reason}", f"the authorizer's credential does not check: {exc}"
            ) from None
    number = (int, float)
    return JoinStatus(
        status=status,
        request_id=meta.get("request_id") if isinstance(meta.get("request_id"), int) else None,
        position=meta.get("position") if isinstance(meta.get("position"), int) else None,
        eta_s=float(meta["eta_s"]) if isinstance(meta.get("eta_s"), number) else None,
        stage=meta.get("stage") if isinstance(meta.get("stage"), int) else None,
        poll_s=float(meta["poll_s"]) if isinstance(meta.get("poll_s"), number) else 1.0,
        credential=credential,
        reason=str(meta.get("reason", "")),
        detail=str(meta.get("detail", "")),
    )


class Admission:
    """One admission of ``key`` through the authorizer at ``authorizer``."""

    def __init__(self, *, client: RpcClient, authorizer: str, key: NodeKey, authorizer_key: bytes, run: str):
        self.client = client
        self.authorizer = authorizer
        self.key = key
        self.authorizer_key = authorizer_key
        self.run = run
        self.last: JoinStatus | None = None

    def _parse(self, meta: Any) -> JoinStatus:
        self.last = parse_status(
            meta, authorizer_key=self.authorizer_key, run=self.run, public_key=self.key.public_key
        )
        return self.last

    async def submit(self, request: JoinRequest) -> JoinStatus:
        signed = sign_join_request(self.key, request)
        reply = await self.client.call(
            self.authorizer, Method.ADMISSION_JOIN, {"request": signed.to_value()}, timeout_s=JOIN_TIMEOUT_S
        )
        return self._parse(reply.meta)

    async def poll(self) -> JoinStatus:
        if self.last is None or self.last.request_id is None:
            raise RuntimeError("poll() before submit() was queued")
        meta = {"request_id": self.last.request_id, "node_id": self.key.node_id}
        reply = await self.client.call(self.authorizer, Method.ADMISSION_POLL, meta, timeout_s=POLL_TIMEOUT_S)
        return self._parse(reply.meta)

    async def wait(
        self, *, on_status: Callable[[JoinStatus], None] | None = None, timeout_s: float | None = None
    ) -> JoinStatus:
        """Poll until admitted (returned) or refused (AdmissionRefused); ``on_status`` sees
        every answer, the first included. Transport errors while queued are retried."""
        if self.last is None:
            raise RuntimeError("wait() before submit()")
        deadline = None if timeout_s is None else world.monotonic() + timeout_s
        status = self.last
        while True:
            if on_status is not None:
                on_status(status)
            if status.status == "refused":
                raise AdmissionRefused(status.reason, status.detail)
            if status.status == "admitted":
                return status
            if deadline is not None and world.monotonic() >= deadline:
                raise AdmissionRefused(
                    "timeout", f"still queued at position {status.position} after {timeout_s:g} s"
                )
            await asyncio.sleep(max(0.05, min(status.poll_s, 30.0)))  # the authorizer's pacing
            try:
                status = await self.poll()
            except AgoraError as exc:
                if isinstance(exc, AdmissionRefused):
                    raise
                status = self.last  # the authorizer is restarting or slow: ask again
