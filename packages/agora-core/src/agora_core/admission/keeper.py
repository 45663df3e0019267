"""Keeping a credential fresh: refresh at two thirds of its life, give up when it expires.

:class:`CredentialKeeper` runs beside a node. It asks the authorizer for the next credential
when the current one is two thirds through its life and retries transport failures every
``retry_s`` until the credential expires. A refusal (the node or its account was banned,
the credential revoked) or expiry calls ``on_lost`` with the reason: the node then stops
serving. A node never serves on an expired credential.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agora_core import world
from agora_core.admission.credential import SignedCredential
from agora_core.admission.join_client import AdmissionRefused, parse_status
from agora_core.admission.join_request import RefreshRequest, sign_refresh_request
from agora_core.contract import Method
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.rpc import RpcClient

log = get_logger("admission.keeper")
REFRESH_TIMEOUT_S = 10.0


class CredentialKeeper:
    def __init__(
        self,
        *,
        client: RpcClient,
        authorizer: str,
        key: NodeKey,
        authorizer_key: bytes,
        run: str,
        credential: SignedCredential,
        on_lost: Callable[[str, str], None],
        retry_s: float = 5.0,
        on_refreshed: Callable[[SignedCredential], None] | None = None,
    ):
        self.client = client
        self.authorizer = authorizer
        self.key = key
        self.authorizer_key = authorizer_key
        self.run_name = run
        self.current = credential
        self.on_lost = on_lost
        self.retry_s = retry_s
        self.on_refreshed = on_refreshed
        self.refreshes = 0
        self.failures = 0
        self.lost: str | None = None  # the reason, once lost

    def valid(self, now: float | None = None) -> bool:
        return self.lost is None and self.current.credential.remaining_s(now) > 0

    async def refresh(self) -> SignedCredential:
        """Ask for the next credential now; AdmissionRefused when the authorizer says no."""
        signed = sign_refresh_request(
            self.key,
            RefreshRequest(
                run=self.run_name, node_id=self.key.node_id, serial=self.current.credential.serial
            ),
        )
        reply = await self.client.call(
            self.authorizer,
            Method.ADMISSION_REFRESH,
            {"request": signed.to_value()},
            timeout_s=REFRESH_TIMEOUT_S,
        )
        status = parse_status(
            reply.meta, authorizer_key=self.authorizer_key, run=self.run_name, public_key=self.key.public_key
        )
        if status.status != "admitted" or status.credential is None:
            raise AdmissionRefused(status.reason or status.status, status.detail)
        self.current = status.credential
        self.refreshes += 1
        if self.on_refreshed is not None:
            self.on_refreshed(status.credential)
        return status.credential

    def _lose(self, reason: str, detail: str) -> None:
        self.lost = reason
        log.warning("credential_lost", reason=reason, detail=detail, serial=self.current.credential.serial)
        self.on_lost(reason, detail)

    async def run(self) -> None:
        """Refresh until the credential is lost (returns then) or the task is cancelled."""
        while True:
            credential = self.current.credential
            await asyncio.sleep(max(0.0, credential.refresh_at - world.wall()))
            while True:
                remaining = credential.remaining_s()
                if remaining <= 0:
                    self._lose("expired", f"credential {credential.serial} expired and no refresh succeeded")
                    return
                try:
                    fresh = await self.refresh()
                except AdmissionRefused as exc:
                    self._lose(exc.reason, exc.detail)
                    return
                except AgoraError as exc:  # the authorizer is down or slow: try again, until expiry
                    self.failures += 1
                    log.warning("credential_refresh_failed", error=str(exc), expires_in_s=round(remaining, 1))
                    await asyncio.sleep(min(self.retry_s, max(0.0, credential.remaining_s())))
                    continue
                log.info(
                    "credential_refreshed",
                    serial=fresh.credential.serial,
                    expires_in_s=round(fresh.credential.remaining_s(), 1),
                )
                break
