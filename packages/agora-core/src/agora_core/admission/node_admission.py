"""A node's admission to a run, around its own start: from the dial-back to the lost credential.

In an authorized run (``[admission] mode = "authorized"``) a worker or trainer holds one
:class:`NodeAdmission`. It binds the node's RPC port before the node joins the DHT and serves
the authorizer's dial-back there (:class:`~agora_core.admission.answerer.DialBackAnswerer`),
submits the signed join request and follows the queue (every change of status, position or
stage goes to ``on_status``). A worker learns its stage while still queued (:meth:`placed`),
so it can download that stage's state meanwhile; :meth:`admitted` returns once the
credential is in hand. Then :meth:`run` keeps the credential fresh (``CredentialKeeper``) and
reads the run's revocation list from the DHT: when a refresh is refused, the credential
expires, or the node's id is on the list, ``lost`` says why and ``on_lost`` is called; the
node then stops serving.

An open run holds an :class:`OpenAdmission` instead: always valid, never lost. Nodes run the
same code in both modes; the run config decides which object they get.
"""

from __future__ import annotations

import asyncio
import os
import platform
from collections.abc import Callable

import numpy as np

from agora_core import world
from agora_core.admission.answerer import DialBackAnswerer
from agora_core.admission.credential import SignedCredential
from agora_core.admission.join_client import Admission, AdmissionRefused, JoinStatus
from agora_core.admission.join_request import HardwareReport, JoinRequest
from agora_core.admission.keeper import CredentialKeeper
from agora_core.admission.revocations import Revocations, parse_revocations, revocations_key
from agora_core.admission.software import software_report
from agora_core.config import NodeSettings, RunConfig
from agora_core.dht import DhtError, DhtNode
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.logs import get_logger

log = get_logger("admission.node")

# The exit code of a node whose credential was lost (a worker's DepartureReason.CREDENTIAL_LOST,
# next to its other self-termination codes 10-15; a trainer exits with it too).
CREDENTIAL_LOST_EXIT_CODE = 16
QUEUE_TIMEOUT_S = 3600.0  # the longest a node waits in the authorizer's queue before giving up
STATUS_KEYS = ("status", "position", "stage")  # a status line is printed when one of these changes


def host_memory_bytes() -> int:
    """This machine's physical memory (0 where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def cpu_hardware() -> HardwareReport:
    """The hardware report of a node that computes on its CPU: its memory is the host's."""
    memory = host_memory_bytes()
    return HardwareReport(
        device="cpu",
        device_name=platform.processor() or platform.machine(),
        device_memory_bytes=memory,
        host_memory_bytes=memory,
        cpu_count=os.cpu_count() or 0,
    )


class OpenAdmission:
    """The admission of a node in an open run: nothing to ask, nothing to lose."""

    authorized = False
    lost: tuple[str, str] | None = None
    stage: int | None = None
    valid = True

    async def admitted(self) -> None:
        return None

    async def run(self, *, revocations_every_s: float | None = None) -> None:
        """Nothing to keep fresh: returns at once."""

    def observe(self, revocations: Revocations | None) -> None:
        return None

    def close(self) -> None:
        return None

    def info(self) -> None:
        return None


class NodeAdmission:
    """The admission of a node in an authorized run (see the module's docstring)."""

    authorized = True

    def __init__(
        self,
        *,
        run: RunConfig,
        node: RunNode,
        key: NodeKey,
        role: str,
        settings: NodeSettings,
        hardware: HardwareReport,
        matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul,
        on_status: Callable[[JoinStatus], None] | None = None,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
    ):
        """``node``: the node's RunNode, not started yet (its port is bound by :meth:`submit`);
        ``matmul``: how the compute challenge multiplies (a worker passes its device's)."""
        authorizer_key = run.admission.authorizer_key_bytes
        if not run.admission.authorized or authorizer_key is None or not settings.authorizer:
            raise ValueError("NodeAdmission is for an authorized run and a node given --authorizer")
        self.run_config, self.node, self.key, self.role = run, node, key, role
        self.settings, self.hardware = settings, hardware
        self.authorizer = settings.authorizer
        self.authorizer_key = authorizer_key
        self.on_status = on_status
        self.queue_timeout_s = queue_timeout_s
        self.on_lost: list[Callable[[str, str], None]] = []
        self.answerer = DialBackAnswerer(
            key,
            run.name,
            matmul,
            max_width=run.admission.challenge_width_for(run.model.d_model),
            max_probe_bytes=run.admission.bandwidth_probe_bytes,
        )
        self.answerer.register(node.server)
        self.admission = Admission(
            client=node.client,
            authorizer=self.authorizer,
            key=key,
            authorizer_key=authorizer_key,
            run=run.name,
        )
        self.status: JoinStatus | None = None
        self.stage: int | None = None  # a worker's stage, once the authorizer placed it
        self.keeper: CredentialKeeper | None = None
        self.lost: tuple[str, str] | None = None  # (reason, detail) once the credential is lost
        self.revocations_read = 0  # revocation lists read
        self._placed = asyncio.Event()
        self._waiting: asyncio.Task | None = None
        self._keeping: asyncio.Task | None = None  # the keeper's refresh loop, once admitted

    # --- joining -----------------------------------------------------------------------------

    async def submit(self) -> JoinStatus:
        """Serve the dial-back on the node's port, send the join request, and keep following
        the queue in the background. AdmissionRefused when the authorizer says no."""
        address = await self.node.serve()
        request = JoinRequest(
            run=self.run_config.name,
            node_id=self.key.node_id,
            public_key=self.key.public_key,
            role=self.role,
            address=self.settings.advertise or address,
            account=self.settings.account or "",
            account_token=self.settings.account_token or "",
            hardware=self.hardware,
            software=software_report(self.role),
        )
        log.info("admission_requested", authorizer=self.authorizer, role=self.role, address=request.address)
        status = await self.admission.submit(request)
        self._seen(status)
        if status.status == "refused":
            raise AdmissionRefused(status.reason, status.detail)
        self._waiting = asyncio.get_running_loop().create_task(
            self.admission.wait(on_status=self._seen, timeout_s=self.queue_timeout_s), name="admission-wait"
        )
        self._waiting.add_done_callback(self._on_admitted)
        return status

    def _on_admitted(self, waiting: asyncio.Task) -> None:
        """Keep the credential fresh from the moment it arrives, not from when the node is
        done downloading: a download longer than a credential's life must not outlive it."""
        if waiting.cancelled() or waiting.exception() is not None or self._keeping is not None:
            return
        self._keeping = asyncio.get_running_loop().create_task(self._keep(), name="credential-keeper")

    async def _keep(self) -> None:
        try:
            await self.admitted()
        except AdmissionRefused:  # the node's own admitted() call raises it where it is awaited
            return
        assert self.keeper is not None
        await self.keeper.run()

    def _seen(self, status: JoinStatus) -> None:
        previous, self.status = self.status, status
        stage = status.stage
        if status.credential is not None and status.credential.credential.stage is not None:
            stage = status.credential.credential.stage
        if stage is not None and self.stage is None:
            self.stage = stage
        if stage is not None or status.status == "admitted":
            self._placed.set()
        if self.on_status is not None and (
            previous is None or any(getattr(previous, k) != getattr(status, k) for k in STATUS_KEYS)
        ):
            self.on_status(status)

    def _queue(self) -> asyncio.Task:
        if self._waiting is None:
            raise RuntimeError("submit() first")
        return self._waiting

    async def placed(self) -> int | None:
        """Once the authorizer named the stage (queued or admitted): that stage (None for a
        role without one). AdmissionRefused when refused first."""
        waiting = self._queue()
        placed = asyncio.get_running_loop().create_task(self._placed.wait())
        try:
            await asyncio.wait({placed, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            placed.cancel()
        if not self._placed.is_set():
            waiting.result()  # raises why it ended (refused, timed out)
        return self.stage

    async def admitted(self) -> SignedCredential:
        """The credential, once admitted; AdmissionRefused when refused or timed out."""
        status = await asyncio.shield(self._queue())
        credential = status.credential
        assert credential is not None  # Admission.wait returns admitted statuses only
        stage = credential.credential.stage
        if self.stage is not None and stage != self.stage:
            raise AdmissionRefused(
                "stage_changed",
                f"the authorizer placed this node on stage {self.stage} but admitted it to stage {stage}",
            )
        self.answerer.active = False  # admitted: nobody may make it compute or send for the asking
        if self.keeper is None:
            self.keeper = CredentialKeeper(
                client=self.node.client,
                authorizer=self.authorizer,
                key=self.key,
                authorizer_key=self.authorizer_key,
                run=self.run_config.name,
                credential=credential,
                on_lost=self._lose,
                on_refreshed=self.node.set_credential,
            )
            self.node.set_credential(credential)  # presented on every connection from now on
            log.info(
                "admitted",
                role=self.role,
                stage=stage,
                serial=credential.credential.serial,
                expires_in_s=round(credential.credential.remaining_s(), 1),
            )
        return credential

    # --- keeping it -----------------------------------------------------------------------------

    @property
    def valid(self) -> bool:
        """Admitted, not lost, not expired: the node may serve."""
        return self.keeper is not None and self.keeper.valid()

    async def run(self, *, revocations_every_s: float | None = None) -> None:
        """Keep the credential fresh, and with ``revocations_every_s`` read the revocation list
        that often, until the credential is lost (returns then) or the task is cancelled."""
        if self.keeper is None:
            raise RuntimeError("run() before admitted()")
        if self._keeping is None:
            self._keeping = asyncio.get_running_loop().create_task(
                self.keeper.run(), name="credential-keeper"
            )
        tasks = [self._keeping]
        if revocations_every_s is not None:
            tasks.append(asyncio.get_running_loop().create_task(self._watch(revocations_every_s)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, every_s: float) -> None:
        while self.lost is None:
            await asyncio.sleep(every_s)
            try:
                self.observe(await self.read_revocations(self.node.dht))
            except (DhtError, RpcError, TimeoutError) as exc:
                log.debug("revocations_unread", error=str(exc) or type(exc).__name__)

    async def read_revocations(self, dht: DhtNode) -> Revocations | None:
        found = await dht.get(revocations_key(self.run_config.name))
        return parse_revocations(found, self.authorizer_key)

    def observe(self, revocations: Revocations | None) -> None:
        """A revocation list just read: the node's credential is lost if it names it."""
        if revocations is None:
            return
        self.node.observe_revocations(revocations)  # its peers on the list are dropped too
        self.revocations_read += 1
        if revocations.revokes(self.key.node_id, self.settings.account):
            self._lose("revoked", "this node (or its account) is on the run's revocation list")

    def _lose(self, reason: str, detail: str) -> None:
        if self.lost is not None:
            return
        self.lost = (reason, detail)
        if self.keeper is not None:
            self.keeper.lost = reason  # a keeper that did not notice itself stops counting as valid
        log.warning("admission_lost", reason=reason, detail=detail, role=self.role)
        for callback in self.on_lost:
            callback(reason, detail)

    def close(self) -> None:
        for task in (self._waiting, self._keeping):
            if task is not None and not task.done():
                task.cancel()

    def info(self) -> dict:
        """What ``worker.info`` (and status lines) say about the credential."""
        current = None if self.keeper is None else self.keeper.current.credential
        return {
            "authorizer": self.authorizer,
            "status": None if self.status is None else self.status.status,
            "stage": self.stage,
            "serial": None if current is None else current.serial,
            "issued": None if current is None else current.issued,
            "expires": None if current is None else current.expires,
            "expires_in_s": None if current is None else round(current.expires - world.wall(), 1),
            "refreshes": 0 if self.keeper is None else self.keeper.refreshes,
            "refresh_failures": 0 if self.keeper is None else self.keeper.failures,
            "valid": self.valid,
            "lost": None if self.lost is None else {"reason": self.lost[0], "detail": self.lost[1]},
        }
