"""The authorizer service: admission.join, .poll, .refresh and .status over the agora RPC.

A join request is opened (signature, run, freshness), its nonce remembered (replays are
refused), recorded, then checked: accountability and hardware floors and software (no
network), then the dial-back (reachability, key, latency, bandwidth, compute). A request
that passes is placed on a stage (workers) and queued; the queue releases it through the
token bucket, and its credential is issued in the same transaction that records it admitted.
Every step is committed before the joiner hears of it, so a killed authorizer loses nothing
it answered; requests it was still checking are marked interrupted on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agora_authorizer.accusations import AccusationJudge
from agora_authorizer.answers import Waiting, admitted_answer, queued_answer, request_fields
from agora_authorizer.bucket import TokenBucket
from agora_authorizer.checks import SoftwarePolicy, check_hardware
from agora_authorizer.dialback import dial_back
from agora_authorizer.issuing import CredentialIssuer
from agora_authorizer.placement import Placer
from agora_authorizer.queue import AdmissionQueue
from agora_authorizer.revocation_publisher import RevocationPublisher
from agora_authorizer.status import status_report
from agora_authorizer.store import Banned, IssuedCredential, NotFound, Store
from agora_authorizer.store.rows import Standing
from agora_core import world
from agora_core.admission import JoinRequest, Refusal, RefusalReason, open_join_request
from agora_core.auth.access import ANYONE
from agora_core.config import RunConfig
from agora_core.contract import Method
from agora_core.errors import BadRequest
from agora_core.identity import NodeKey
from agora_core.node.role import RoleNode
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, Request

log = get_logger("authorizer")
RECENT_ADMISSIONS = 4096  # admitted requests answered from memory


class Authorizer:
    def __init__(
        self,
        *,
        run: RunConfig,
        key: NodeKey,
        store: Store,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        advertise: str | None = None,
        allowed_software: Sequence[str] = (),
        metrics: NodeMetrics | None = None,
    ):
        self.run = run
        self.config = run.admission
        self.key = key
        self.store = store
        self.member = RoleNode.build(
            "authorizer", run, key, metrics=metrics, listen=listen, bootstrap=bootstrap, advertise=advertise
        )
        self.node, self.metrics = self.member.node, self.member.metrics
        self.server, self.client, self.dht = self.node.server, self.node.client, self.node.dht
        self.software = SoftwarePolicy([*self.config.allowed_software, *allowed_software])
        self.challenge_width = self.config.challenge_width_for(run.model.d_model)
        # One database thread: the store's calls are short and their order is the commit order.
        self._db_thread = ThreadPoolExecutor(1, thread_name_prefix="authorizer-db")
        self.issuer = CredentialIssuer(run=run, key=key, store=store, db=self.db)
        self.bucket = TokenBucket(self.config.admissions_per_minute, self.config.admission_burst)
        self.queue = AdmissionQueue(self.bucket, self._admit)
        self.revocations = RevocationPublisher(run=run, key=key, store=store, dht=self.dht, db=self.db)
        self.revocations.on_published = self.node.observe_revocations  # drop banned peers at once
        self.judge = AccusationJudge(
            run=run, store=store, dht=self.dht, db=self.db, revocations=self.revocations, metrics=self.metrics
        )
        self._place_lock = asyncio.Lock()
        self.placer = Placer(run=run, dht=self.dht, store=store, db=self.db)
        self._checking: dict[str, set[str]] = {}  # account -> node ids being checked now
        self._waiting: dict[int, Waiting] = {}  # queued request id -> what its credential names
        self._admitted: OrderedDict[int, IssuedCredential] = OrderedDict()  # recent, for the answers
        self._tasks: list[asyncio.Task] = []
        self.address: str | None = None
        self._m_requests = self.metrics.counter(
            "agora_authorizer_requests_total", "Join requests by outcome and reason.", ["outcome", "reason"]
        )
        queue_length = self.metrics.gauge("agora_authorizer_queue_length", "Checked requests waiting.")
        queue_length.set_function(lambda: len(self.queue))  # read when scraped
        for method, handler in (
            (Method.ADMISSION_JOIN, self._on_join),
            (Method.ADMISSION_POLL, self._on_poll),
            (Method.ADMISSION_REFRESH, self.issuer.on_refresh),
            (Method.ADMISSION_STATUS, self._on_status),
        ):
            self.server.register(method, handler, access=ANYONE)  # joiners hold no credential yet

    async def db(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await world.offload_to(self._db_thread, fn, *args, **kwargs)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Recover the queue, serve, join the DHT, release the queue, publish revocations,
        judge accusations."""
        now = world.wall()
        interrupted = await self.db(self.store.interrupt_checking, now=now)
        if interrupted:
            log.warning("requests_interrupted", count=interrupted)
        queued = await self.db(self.store.queued)
        self.queue.load([r.id for r in queued])
        for r in queued:
            self._waiting[r.id] = Waiting(
                node_id=r.node_id, public_key=r.public_key, role=r.role, stage=r.stage, account=r.account
            )
        self.address = await self.node.start()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.queue.run(), name="authorizer-queue"),
            loop.create_task(self.revocations.run(), name="authorizer-revocations"),
            loop.create_task(self.judge.run(), name="authorizer-accusations"),
        ]
        log.info("authorizer_started", address=self.address, queued=len(self.queue), run=self.run.name)
        return self.address

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.node.stop()
        self._db_thread.shutdown(wait=True)

    # --- join ------------------------------------------------------------------------------

    def _answer(self, refusal: Refusal, request_id: int | None = None) -> Payload:
        self._m_requests.labels(outcome="refused", reason=refusal.reason.value).inc()
        return Payload({**refusal.to_value(), "request_id": request_id})

    async def _refuse(self, request_id: int, refusal: Refusal, checks: dict | None = None) -> Payload:
        await self.db(
            self.store.set_request,
            request_id,
            status="refused",
            reason=refusal.reason.value,
            detail=refusal.detail,
            checks=checks,
            now=world.wall(),
        )
        log.info("join_refused", request_id=request_id, reason=refusal.reason.value, detail=refusal.detail)
        return self._answer(refusal, request_id)

    async def _on_join(self, request: Request) -> Payload:
        now = world.wall()
        recorded: list[int] = []
        try:
            return await self._join(request, now, recorded)
        except asyncio.CancelledError:
            # the joiner gave up (its deadline) while this was checked: say so on record,
            # or the request would read "checking" until the next restart
            if recorded and self.queue.position(recorded[0]) is None and recorded[0] not in self._admitted:
                interrupted = Refusal(
                    RefusalReason.INTERRUPTED, "the joiner stopped waiting during the checks"
                )
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._refuse(recorded[0], interrupted))
            raise

    async def _join(self, request: Request, now: float, recorded: list[int]) -> Payload:
        value = request.meta.get("request") if isinstance(request.meta, dict) else None
        opened = open_join_request(value, run=self.run.name, now=now, max_age_s=self.config.request_max_age_s)
        if isinstance(opened, Refusal):
            return await self._refuse(await self.db(self.store.add_unopened_request, now=now), opened)
        fields = request_fields(opened)
        request_id = await self.db(self.store.record_request, nonce=opened.nonce, now=now, **fields)
        if request_id is not None:
            recorded.append(request_id)
        if request_id is None:
            refusal = Refusal(RefusalReason.REPLAYED, "this request was sent before: sign a fresh one")
            return await self._refuse(await self.db(self.store.add_request, now=now, **fields), refusal)
        account = opened.account
        checking = self._checking.setdefault(account, set())
        others_checking = len(checking - {opened.node_id})
        checking.add(opened.node_id)
        self.queue.checking(request_id)
        try:
            standing = await self.db(
                self.store.standing, account, opened.account_token, opened.node_id, now=now
            )
            refusal = (
                self._accountability(opened, standing, others_checking)
                or check_hardware(self.config, opened.role, opened.hardware)
                or self.software.check(opened)
            )
            if refusal is not None:
                return await self._refuse(request_id, refusal)
            dialed = await dial_back(
                self.client,
                opened,
                run=self.run.name,
                config=self.config,
                challenge_width=self.challenge_width,
            )
            if dialed.refusal is not None:
                return await self._refuse(request_id, dialed.refusal, dialed.measured)
            stage = await self._enqueue(opened, request_id, dialed.measured, pin=standing.pin)
        finally:
            checking.discard(opened.node_id)
            if not checking:
                self._checking.pop(account, None)
            self.queue.checked(request_id)
        log.info(
            "join_queued", request_id=request_id, node=opened.node_id[:12], role=opened.role, stage=stage
        )
        try:
            await self.queue.release_ready()  # a token waiting: admitted in this very answer
        except Exception:  # the queue's head failed (logged there); this request is queued
            pass
        return Payload(await self._status_of(request_id))

    def _accountability(
        self, opened: JoinRequest, standing: Standing, others_checking: int
    ) -> Refusal | None:
        if standing.account is None:
            return Refusal(
                RefusalReason.UNKNOWN_ACCOUNT,
                f"no account {opened.account!r} with that token (the operator creates accounts: "
                "agora-authorizer account add)",
            )
        if standing.account_banned:
            return Refusal(
                RefusalReason.BANNED_ACCOUNT, f"account {opened.account!r} is banned from this run"
            )
        if standing.node_banned:
            return Refusal(RefusalReason.BANNED_NODE, f"node {opened.node_id} is banned from this run")
        limit = standing.account.max_nodes or self.config.max_nodes_per_account
        # its other nodes: live, queued, and being checked right now
        in_flight = standing.live_nodes + standing.queued_nodes + others_checking
        if in_flight >= limit:
            return Refusal(
                RefusalReason.ACCOUNT_LIMIT,
                f"account {opened.account!r} already has {in_flight} nodes in the run (at most {limit})",
            )
        return None

    async def _enqueue(
        self, opened: JoinRequest, request_id: int, checks: dict, *, pin: int | None
    ) -> int | None:
        """Place a worker (under a lock, so concurrent joiners see each other's placements),
        then admit the request at once when nothing is ahead of it and the bucket has a
        token (one commit), else queue it (its place committed first)."""
        stage = None
        if opened.role == "worker":
            stage = pin if pin is not None and pin < self.run.model.n_stages else None  # a stale pin: ignored
            if stage is None:
                async with self._place_lock:
                    stage = await self.placer.least_provisioned()
                    self.placer.promise(stage, opened.node_id)
        self._waiting[request_id] = Waiting(
            node_id=opened.node_id,
            public_key=opened.public_key,
            role=opened.role,
            stage=stage,
            account=opened.account,
            checks=checks,
        )
        try:
            if not await self.queue.admit_at_once(request_id):
                await self.db(
                    self.store.set_request,
                    request_id,
                    status="queued",
                    stage=stage,
                    checks=checks,
                    now=world.wall(),
                )
                self.queue.add(request_id)
        except BaseException:
            self._waiting.pop(request_id, None)
            raise
        return stage

    async def _admit(self, request_id: int) -> None:
        """Issue a released request's credential. A node or account banned while it waited
        is refused instead; a request that is no longer pending (a restart raced it) is
        dropped: neither may hold up the queue."""
        waiting = self._waiting.get(request_id)
        if waiting is None:  # queued before a restart
            row = await self.db(self.store.request, request_id)
            if row is None or row.status != "queued":
                log.warning(
                    "release_skipped", request_id=request_id, status=None if row is None else row.status
                )
                return
            waiting = Waiting(
                node_id=row.node_id,
                public_key=row.public_key,
                role=row.role,
                stage=row.stage,
                account=row.account,
            )
        try:
            issued = await self.issuer.admit(request_id, **dataclasses.asdict(waiting))
        except Banned as banned:
            reason = RefusalReason.BANNED_NODE if banned.kind == "node" else RefusalReason.BANNED_ACCOUNT
            await self._refuse(
                request_id, Refusal(reason, f"{banned.kind} {banned.target} was banned while it waited")
            )
            return
        except NotFound as exc:
            log.warning("release_skipped", request_id=request_id, error=str(exc))
            return
        finally:
            self._waiting.pop(request_id, None)
        self._admitted[request_id] = issued
        while len(self._admitted) > RECENT_ADMISSIONS:
            self._admitted.popitem(last=False)
        self._m_requests.labels(outcome="admitted", reason="").inc()

    # --- poll and status ---------------------------------------------------------------------

    async def _status_of(self, request_id: int) -> dict:
        """Where request ``request_id`` stands: from memory while it waits or was just
        admitted, else from the database."""
        issued = self._admitted.get(request_id)
        if issued is not None:
            return admitted_answer(request_id, issued)
        if request_id in self._waiting:
            return queued_answer(self.queue, request_id, self._waiting[request_id].stage)
        row = await self.db(self.store.request, request_id)
        if row is None:
            raise BadRequest(f"no admission request {request_id}")
        if row.status == "queued":
            return queued_answer(self.queue, row.id, row.stage)
        if row.status == "admitted":
            return admitted_answer(row.id, await self.db(self.store.latest_credential_of, row.node_id))
        if row.status == "refused":
            return {"status": "refused", "request_id": row.id, "reason": row.reason, "detail": row.detail}
        # still being checked by another call
        return {"status": "queued", "request_id": row.id, "position": len(self.queue) + 1, "poll_s": 1.0}

    async def _on_poll(self, request: Request) -> Payload:
        meta = request.meta if isinstance(request.meta, dict) else {}
        request_id, node_id = meta.get("request_id"), meta.get("node_id")
        if not isinstance(request_id, int) or not 0 < request_id < 2**63 or not isinstance(node_id, str):
            raise BadRequest("admission.poll needs {'request_id': int, 'node_id': str}")
        known = self._waiting.get(request_id) or self._admitted.get(request_id)
        owner = known.node_id if known is not None else None
        if owner is None:
            row = await self.db(self.store.request, request_id)
            owner = None if row is None else row.node_id
        if owner != node_id:
            raise BadRequest(f"node {node_id[:12]} has no admission request {request_id}")
        return Payload(await self._status_of(request_id))

    async def _on_status(self, request: Request) -> Payload:
        """Counts only (anyone may ask): which node belongs to which account, the bans and
        the database are for operators, through ``agora-authorizer status`` on the database."""
        report = await self.db(status_report, self.store, now=world.wall())
        return Payload(
            {
                "queued": len(report["queue"]),
                "admitted": report["admitted"],
                "requests": report["requests"],
                "refusals": report["refusals"],
                "tokens": None if self.bucket.unlimited else round(self.bucket.tokens(), 2),
                "address": self.address,
            }
        )
