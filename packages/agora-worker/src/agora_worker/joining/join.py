"""Where a starting worker's state comes from: live peers, a checkpoint, or the initial weights.

The worker reads its stage's announcements and progress from the DHT. Live replicas (serving
or optimizer-syncing) more than ``sync.stale_after_steps`` ahead of its own state mean that
state is stale: it downloads theirs (up to ``join.attempts`` tries, each with a fresh list of
donors) and then passes through the sync phases. Otherwise it keeps its own state: the newest
valid checkpoint when it resumes or when no live replica exists, else the initial weights,
and serves at once. A worker whose download fails keeps its own state too but starts in
weight sync, which over a full pass of averaging rounds replaces its weights with the stage's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from agora_core import world
from agora_core.config.run import RunConfig
from agora_core.contract import Phase
from agora_core.dht import DhtError, DhtNode
from agora_core.errors import AgoraError, RpcError
from agora_core.injection import NO_INJECTIONS, InjectionPoints
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient
from agora_core.schema import (
    StageProgress,
    WorkerAnnouncement,
    parse_entries,
    stage_progress_key,
    stage_workers_key,
)
from agora_worker.joining.download import DownloadProgress, StateDownloadFailed, download_state
from agora_worker.joining.phases import PhaseTracker
from agora_worker.progress.decision import heard_steps
from agora_worker.serving.runtime import Runtime
from agora_worker.state.snapshot import StageState, StateMismatch, StateSnapshot

log = get_logger("worker.join")

Source = Literal["peers", "checkpoint", "initial"]
DownloadPolicy = Literal["auto", "always", "never"]


@dataclass
class JoinOutcome:
    source: Source
    step: int  # the optimizer step the worker starts from
    stage_step: int  # its stage's furthest step when it looked
    donors: list[str] = field(default_factory=list)  # node ids the state came from
    download_bytes: int = 0
    download_s: float = 0.0  # manifests to every tensor fetched and its digest checked
    install_s: float = 0.0  # installing it and reading it back
    failed_pieces: int = 0
    refetched_tensors: int = 0
    verified: bool = False  # the installed state read back equals the donors' snapshot digests

    def info(self) -> dict:
        rate = self.download_bytes / self.download_s if self.download_s else 0.0
        return {
            "source": self.source,
            "step": self.step,
            "stage_step": self.stage_step,
            "donors": self.donors,
            "download_bytes": self.download_bytes,
            "download_s": round(self.download_s, 3),
            "install_s": round(self.install_s, 3),
            "rate_bytes_per_s": round(rate),
            "failed_pieces": self.failed_pieces,
            "refetched_tensors": self.refetched_tensors,
            "verified": self.verified,
        }


@dataclass(frozen=True)
class StageView:
    donors: list[WorkerAnnouncement]  # live replicas with current state, most advanced first
    stage_step: int


class Joiner:
    def __init__(
        self,
        *,
        run: RunConfig,
        stage: int,
        node_id: str,
        dht: DhtNode,
        client: RpcClient,
        runtime: Runtime,
        state: StageState,
        phases: PhaseTracker,
        metrics: NodeMetrics,
        policy: DownloadPolicy = "auto",
        resume: Callable[..., Awaitable[int | None]] | None = None,
        announce: Callable[[], Awaitable[None]] | None = None,
        injections: InjectionPoints = NO_INJECTIONS,
    ):
        """``resume(live_replicas=...)`` installs the newest valid checkpoint when the worker
        resumes or its stage has no live replica, and returns its step (None: it did not);
        ``announce()`` publishes the worker's announcement (its phase shows it downloading)."""
        self._run, self._stage, self._node_id = run, stage, node_id
        self._dht, self._client, self._runtime, self._state = dht, client, runtime, state
        self._phases, self._policy = phases, policy
        self._resume, self._announce = resume, announce
        self._injections = injections  # the operator's mid-download trigger
        self.progress: DownloadProgress | None = None
        self._m_done = metrics.gauge("agora_join_download_bytes", "State bytes downloaded so far.")
        self._m_total = metrics.gauge("agora_join_download_total_bytes", "State bytes to download.")
        self._m_rate = metrics.gauge("agora_join_download_bytes_per_second", "State download rate.")

    async def look(self) -> StageView:
        """The stage's live replicas and furthest step, from the DHT (a step claimed too far
        past the quorum's is not heard: :func:`~agora_worker.progress.decision.heard_steps`)."""
        run, stage = self._run.name, self._stage
        found, reports = await asyncio.gather(
            self._dht.get(stage_workers_key(run, stage)), self._dht.get(stage_progress_key(run, stage))
        )
        live = self._dht.live_ids() - {self._node_id}  # a crashed replica's entries outlive it
        claimed = {
            p.node_id: p.step for p in parse_entries(reports, StageProgress.from_value) if p.node_id in live
        }
        progress = heard_steps(claimed)  # a minority claiming far steps neither leads nor donates first
        donors = [
            a
            for a in parse_entries(found, WorkerAnnouncement.from_value)
            if a.node_id in live and a.phase in (Phase.SERVING, Phase.OPTIMIZER_SYNC) and a.address
        ]
        donors.sort(key=lambda a: (-progress.get(a.node_id, -1), a.phase is not Phase.SERVING, -a.throughput))
        return StageView(donors, max(progress.values(), default=0))

    async def join(self) -> JoinOutcome:
        try:
            view = await self.look()
        except (DhtError, RpcError) as exc:
            log.warning("join_stage_unknown", error=str(exc))
            view = StageView([], 0)
        local_step = 0
        source: Source = "initial"
        if self._resume is not None and self._policy != "always":
            resumed = await self._resume(live_replicas=bool(view.donors))
            if resumed is not None:
                local_step, source = resumed, "checkpoint"
        behind = view.stage_step - local_step
        wanted = bool(view.donors) and (
            self._policy == "always" or (self._policy == "auto" and behind > self._run.sync.stale_after_steps)
        )
        if not wanted:
            log.info(
                "join_from_own_state",
                source=source,
                step=local_step,
                stage_step=view.stage_step,
                live_replicas=len(view.donors),
            )
            return JoinOutcome(source, local_step, view.stage_step)
        outcome = await self._download(view)
        if outcome is None:  # peers exist but none delivered: converge through averaging instead
            log.warning("join_download_gave_up", source=source, step=local_step, stage_step=view.stage_step)
            self._phases.start_sync(local_step, reason="state download failed")
            return JoinOutcome(source, local_step, view.stage_step)
        self._phases.start_sync(outcome.step, reason="state downloaded from peers")
        return outcome

    async def _download(self, view: StageView) -> JoinOutcome | None:
        self._phases.enter(Phase.DOWNLOADING, 0, reason="live replicas are ahead")
        if self._announce is not None:
            await self._announce()
        expected = self._state.expected_specs()
        required = {s.name for s in self._state.param_specs()}
        config = self._run.join
        for attempt in range(1, config.attempts + 1):
            if attempt > 1:
                try:
                    view = await self.look()
                except (DhtError, RpcError) as exc:
                    log.warning("join_stage_unknown", error=str(exc))
                    continue
            addresses = [a.address for a in view.donors]
            if not addresses:
                continue
            started = world.monotonic()
            log.info(
                "state_download_started",
                attempt=attempt,
                candidates=len(addresses),
                stage_step=view.stage_step,
            )
            try:
                snapshot, download = await download_state(
                    self._client,
                    addresses,
                    expected=expected,
                    required=required,
                    config=config,
                    on_progress=self._report,
                    injections=self._injections,
                )
                downloaded = world.monotonic()
                await asyncio.wrap_future(
                    self._runtime.call(functools.partial(self._state.install, snapshot))
                )
                await self._check_installed(snapshot)
            except (StateDownloadFailed, AgoraError) as exc:
                log.warning("state_download_failed", attempt=attempt, error=str(exc))
                continue
            seconds, install_s = downloaded - started, world.monotonic() - downloaded
            used = [d.node_id for d in download.donors if d.fetched_bytes]
            log.info(
                "state_downloaded",
                step=snapshot.step,
                bytes=download.total_bytes,
                seconds=round(seconds, 3),
                install_s=round(install_s, 3),
                rate_mbit_per_s=round(download.total_bytes * 8 / seconds / 1e6, 1) if seconds else None,
                donors=used,
                failed_pieces=download.failed_pieces,
                refetched_tensors=download.refetched_tensors,
            )
            return JoinOutcome(
                source="peers",
                step=snapshot.step,
                stage_step=view.stage_step,
                donors=used,
                download_bytes=download.total_bytes,
                download_s=seconds,
                install_s=install_s,
                failed_pieces=download.failed_pieces,
                refetched_tensors=download.refetched_tensors,
                verified=True,
            )
        return None

    async def _check_installed(self, snapshot: StateSnapshot) -> None:
        """Read the installed state back: it must be the donors' bytes, bit for bit."""
        installed = await asyncio.wrap_future(self._runtime.call(self._state.capture))
        ours, theirs = await world.offload(lambda: (installed.digests(), snapshot.digests()))
        wrong = sorted(name for name, digest in theirs.items() if ours.get(name) != digest)
        if wrong:
            raise StateMismatch(
                f"installed state differs from the donors' in {len(wrong)} tensors, e.g. {wrong[0]}"
            )

    def _report(self, progress: DownloadProgress) -> None:
        self.progress = progress
        self._m_done.set(progress.done_bytes)
        self._m_total.set(progress.total_bytes)
        self._m_rate.set(progress.rate_bytes_per_s)
        eta = progress.eta_s
        log.info(
            "state_download_progress",
            done_mb=round(progress.done_bytes / 1e6, 1),
            total_mb=round(progress.total_bytes / 1e6, 1),
            rate_mbit_per_s=round(progress.rate_bytes_per_s * 8 / 1e6, 1),
            eta_s=None if eta is None else round(eta, 1),
            donors=progress.donors,
        )
