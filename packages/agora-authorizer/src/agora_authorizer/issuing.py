"""Issuing credentials: on admission, and on every refresh a node asks for.

A credential's serial comes from the database row it is stored in, and the row, its signed
body and the request's "admitted" status commit in one transaction: a credential the node
holds is always on record. A refresh is signed by the key the credential was issued to, and
is refused when that credential was revoked, its node or account banned, or it expired (a
node whose credential lapsed joins again through the checks).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from agora_authorizer.store import Banned, IssuedCredential, Store
from agora_core import world
from agora_core.admission import (
    Credential,
    Refusal,
    RefusalReason,
    SignedMessage,
    issue_credential,
    open_refresh_request,
)
from agora_core.admission.signed import decode_map
from agora_core.config import RunConfig
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.rpc import Payload, Request

log = get_logger("authorizer.issuing")


class CredentialIssuer:
    def __init__(self, *, run: RunConfig, key: NodeKey, store: Store, db: Callable[..., Awaitable[Any]]):
        self.run = run
        self.key = key
        self.store = store
        self.db = db
        self.lifetime_s = run.admission.credential_lifetime_s

    def _signer(
        self, *, node_id: str, public_key: bytes, role: str, stage: int | None, account: str, issued: float
    ):
        def sign(serial: int) -> tuple[bytes, bytes]:
            credential = Credential(
                run=self.run.name,
                node_id=node_id,
                public_key=public_key,
                role=role,
                stage=stage,
                issued=issued,
                expires=issued + self.lifetime_s,
                serial=serial,
                account=account,
            )
            message = issue_credential(self.key, credential).message
            return message.body, message.signature

        return sign

    def _issue(
        self, *, request_id: int | None, node_id, public_key, role, stage, account, checks=None
    ) -> IssuedCredential:
        """Runs on the database thread: one transaction."""
        issued = world.wall()
        return self.store.issue_credential(
            request_id=request_id,
            node_id=node_id,
            public_key=public_key,
            role=role,
            stage=stage,
            account=account,
            issued=issued,
            expires=issued + self.lifetime_s,
            sign=self._signer(
                node_id=node_id, public_key=public_key, role=role, stage=stage, account=account, issued=issued
            ),
            checks=checks,
        )

    async def admit(
        self,
        request_id: int,
        *,
        node_id: str,
        public_key: bytes,
        role: str,
        stage: int | None,
        account: str,
        checks: dict | None = None,
    ) -> IssuedCredential:
        """Issue request ``request_id``'s credential and record it admitted (with its
        ``checks`` when it never was queued)."""
        issued = await self.db(
            self._issue,
            request_id=request_id,
            node_id=node_id,
            public_key=public_key,
            role=role,
            stage=stage,
            account=account,
            checks=checks,
        )
        log.info("admitted", request_id=request_id, node=node_id[:12], stage=stage, serial=issued.serial)
        return issued

    async def _refusal_for(self, value: Any, now: float) -> tuple[IssuedCredential | None, Refusal | None]:
        message = SignedMessage.from_value(value)
        fields = decode_map(message) if message is not None else None
        serial = fields.get("serial") if fields is not None else None
        valid = isinstance(serial, int) and 0 < serial < 2**63  # beyond: no database holds it
        held = await self.db(self.store.credential, serial) if valid else None
        opened = open_refresh_request(
            value,
            public_key_of=lambda s: held.public_key if held is not None and held.serial == s else None,
            run=self.run.name,
            now=now,
            max_age_s=self.run.admission.request_max_age_s,
        )
        if isinstance(opened, Refusal):
            return held, opened
        assert held is not None
        if not await self.db(self.store.remember_nonce, opened.nonce, now=now):
            return held, Refusal(RefusalReason.REPLAYED, "this refresh was sent before: sign a fresh one")
        if await self.db(self.store.is_banned, "node", held.node_id):
            return held, Refusal(RefusalReason.BANNED_NODE, f"node {held.node_id} is banned from this run")
        if await self.db(self.store.is_banned, "account", held.account):
            return held, Refusal(
                RefusalReason.BANNED_ACCOUNT, f"account {held.account!r} is banned from this run"
            )
        if held.revoked:
            return held, Refusal(RefusalReason.REVOKED, f"credential {held.serial} was revoked")
        if held.expires + self.run.dht.max_clock_skew_s < now:
            return held, Refusal(
                RefusalReason.EXPIRED, f"credential {held.serial} expired: join again (agora-worker run)"
            )
        return held, None

    async def on_refresh(self, request: Request) -> Payload:
        now = world.wall()
        value = request.meta.get("request") if isinstance(request.meta, dict) else None
        held, refusal = await self._refusal_for(value, now)
        if refusal is not None:
            log.info(
                "refresh_refused", serial=None if held is None else held.serial, reason=refusal.reason.value
            )
            return Payload(refusal.to_value())
        assert held is not None
        try:
            fresh = await self.db(
                self._issue,
                request_id=None,
                node_id=held.node_id,
                public_key=held.public_key,
                role=held.role,
                stage=held.stage,
                account=held.account,
            )
        except Banned as banned:  # banned between the check above and the issue
            reason = RefusalReason.BANNED_NODE if banned.kind == "node" else RefusalReason.BANNED_ACCOUNT
            return Payload(
                Refusal(reason, f"{banned.kind} {banned.target} is banned from this run").to_value()
            )
        return Payload(
            {
                "status": "admitted",
                "stage": fresh.stage,
                "credential": {"body": fresh.body, "signature": fresh.signature},
            }
        )
