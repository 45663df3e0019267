"""A worker: one replica of one stage, serving ``forward``, ``backward`` and ``forward_backward``.

It shares one RPC port with its DHT node, announces itself under its stage, coalesces the
requests of many trainers into microbatches on one compute thread, and steps its host-side
optimizer whenever its stage has jointly processed a batch. In an authorized run it is built
on the port its admission already serves (``node``) and is seen only while its credential is
valid (``admission``; see :mod:`agora_worker.admission`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from agora_core import world
from agora_core.auth.access import CREDENTIALED, only
from agora_core.config import RunConfig
from agora_core.contract import Method, Phase, StageRole
from agora_core.dht import DhtError
from agora_core.errors import BadRequest, RpcError
from agora_core.identity import NodeKey
from agora_core.injection import InjectionPoints
from agora_core.node.role import RoleNode
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, Request
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.schema import WorkerAnnouncement
from agora_worker import __version__
from agora_worker.announce import Announcer
from agora_worker.averaging import Averager
from agora_worker.averaging.averager import RoundReport
from agora_worker.info import worker_info
from agora_worker.injections import watcher_for
from agora_worker.joining import Joiner, JoinOutcome, JoinProbation, PhaseTracker, StateDonor
from agora_worker.optimizer.host import StepReport
from agora_worker.progress.tracker import StageProgressTracker
from agora_worker.serving.compute import build_compute
from agora_worker.serving.pipeline import PipelineService
from agora_worker.serving.runtime import Runtime
from agora_worker.settings import WorkerSettings
from agora_worker.state.checkpoint import CheckpointStore
from agora_worker.state.checkpoint_writer import CheckpointWriter
from agora_worker.state.snapshot import StageState
from agora_worker.termination import watchdog_for

log = get_logger("worker")


class Worker:
    def __init__(
        self,
        *,
        run: RunConfig,
        stage: int,
        key: NodeKey,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        advertise: str | None = None,
        settings: WorkerSettings | None = None,
        metrics: NodeMetrics | None = None,
        link: LinkEmulator | None = None,
        member: RoleNode | None = None,
    ):
        """``member``: the node it runs on, already built (an authorized worker's: its port
        bound and its admission given, :mod:`agora_worker.admission`), instead of a new open-run
        member on ``listen`` with ``metrics``."""
        if not 0 <= stage < run.model.n_stages:
            raise ValueError(f"stage {stage} does not exist: the run has stages 0..{run.model.n_stages - 1}")
        self.run = run
        self.stage = stage
        self.key = key
        self.settings = settings or WorkerSettings()
        self.member = RoleNode.given_or_built(
            member,
            "worker",
            run,
            key,
            stage=stage,
            metrics=metrics,
            listen=listen,
            bootstrap=bootstrap,
            advertise=advertise,
            link=link,
        )
        self.node, self.metrics, self.admission = self.member.node, self.member.metrics, self.member.admission
        compute = build_compute(run, stage, self.settings, self.metrics)  # module, optimizer, limits
        self.device, self.module, self.optimizer = compute.device, compute.module, compute.optimizer
        self.role: StageRole = self.module.role
        self.injections = InjectionPoints()  # where the operator's injected failures fire
        self.max_batch = compute.max_batch_samples
        self.runtime = Runtime(
            compute.backend,
            max_batch_samples=self.max_batch,
            max_batch_tokens=compute.max_batch_tokens,
            metrics=self.metrics,
        )
        self.state = StageState(self.module, self.optimizer)
        self._m_phase = self.metrics.gauge(
            "agora_worker_phase", "1 for the phase the worker is in.", ["phase"]
        )
        self.phases = PhaseTracker(run.sync, override=self.settings.phase, on_change=self._phase_changed)
        self._phase_seen = self.phases.phase  # the phase _phase_changed last saw
        self.serving_rounds = 0  # averaging rounds that averaged something since it last began serving
        self._set_phase_metric(self.phases.phase)
        self.server, self.client, self.dht = self.node.server, self.node.client, self.node.dht
        same_stage = only(("worker",), stage=stage)  # who may call what, in an authorized run
        for method, handler, access in (
            (Method.WORKER_INFO, self._on_info, CREDENTIALED),
            (Method.WORKER_PARAMETERS, self._on_parameters, only(("worker", "operator"), stage=stage)),
            (Method.AVERAGING_START, self._on_start_round, same_stage),
            (Method.PROGRESS_POKE, self._on_poke, same_stage),
        ):
            self.server.register(method, handler, access=access)
        self.ready = False  # its state is in place (downloaded or its own): it may donate it
        self.donor = StateDonor(
            state=self.state,
            runtime=self.runtime,
            config=run.join,
            node_id=key.node_id,
            ready=lambda: self.ready,
            metrics=self.metrics,
        )
        self.donor.register(self.server, stage=stage)
        untrained = [p for p in self.module.parameters() if not p.requires_grad]
        self.averager = Averager(
            config=run.averaging,
            chunk_bytes=run.transport.chunk_bytes,
            record_ttl_s=run.dht.record_ttl_s,
            target_batch_size=run.optimizer.target_batch_size,
            run_name=run.name,
            seed=run.seed,
            stage=stage,
            key=key,
            dht=self.dht,
            server=self.server,
            client=self.client,
            runtime=self.runtime,
            optimizer=self.optimizer,
            tensors=list(self.optimizer.master) + untrained,  # dummy parameters travel too
            metrics=self.metrics,
            address=lambda: self.address or "",
            phase=lambda: self.phases.phase,
            injections=self.injections,
            on_round=self._on_round,
        )
        # A joiner's first serving round, held against its peers: too far off, it re-syncs.
        self.probation = JoinProbation(
            ratio=run.sync.max_join_distance_ratio,
            peer_summaries=self.averager.peer_summaries,
            resync=lambda reason: self._resync("join_probation", reason),
        )
        self.progress = StageProgressTracker(
            dht=self.dht,
            key=key,
            run_name=run.name,
            stage=stage,
            target_batch_size=run.optimizer.target_batch_size,
            interval_s=self.settings.progress_interval_s,
            ttl_s=run.dht.record_ttl_s,
            # A worker in optimizer sync trains, but its samples do not count toward the batch.
            local=lambda: (
                self.optimizer.step,
                self.optimizer.samples if self.phases.phase.counts_samples else 0,
            ),
            take_step=self.take_step,
            address=lambda: self.address or "",
            poke=lambda address, step, samples: self.client.call(
                address,
                Method.PROGRESS_POKE,
                {"stage": stage, "node": key.node_id, "step": step, "samples": samples},
                timeout_s=2.0,
            ),
        )
        self.pipeline = PipelineService(
            model=run.model,
            stage=stage,
            role=self.role,
            boundary_width=self.module.boundary_width,
            max_batch=self.max_batch,
            runtime=self.runtime,
            phase=lambda: self.phases.phase,
            trained=self.progress.accumulated,
            admitted=lambda: self.admission.valid,
            injections=self.injections,
        )
        self.pipeline.register(self.server)
        self.announcer = Announcer(
            dht=self.dht,
            key=key,
            run_name=run.name,
            stage=stage,
            interval_s=self.settings.announce_interval_s,
            ttl_s=run.dht.record_ttl_s,
            describe=self.describe,
            allowed=lambda: self.admission.valid,
        )
        self.joiner = Joiner(
            run=run,
            stage=stage,
            node_id=key.node_id,
            dht=self.dht,
            client=self.client,
            runtime=self.runtime,
            state=self.state,
            phases=self.phases,
            metrics=self.metrics,
            policy=self.settings.download,
            resume=self._resume_from_checkpoint,
            announce=self.announcer.announce,
            injections=self.injections,
        )
        self.joined: JoinOutcome | None = None
        self._tasks: list[asyncio.Task] = []
        self._announcing: set[asyncio.Task] = set()
        self.address: str | None = None
        self.last_step: StepReport | None = None
        self._m_step = self.metrics.gauge("agora_worker_optimizer_step", "Optimizer steps taken.")
        self._m_norm = self.metrics.gauge(
            "agora_worker_grad_norm", "Gradient norm before clipping, last step."
        )
        self._m_lr = self.metrics.gauge("agora_worker_learning_rate", "Learning rate of the last step.")
        self._m_staleness = self.metrics.histogram(
            "agora_worker_backward_staleness_steps",
            "Optimizer steps between a sample's forward here and its backward, per sample.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 16),
        )
        versions = self.runtime.backend.versions
        self.metrics.counter_from(
            "agora_worker_backward_samples_total",
            "Backward samples by the weights they recomputed under: their forward's kept version "
            "(kept), the live weights, still their forward's (live), or the live weights because "
            "their forward's version was no longer kept or unknown here (missed).",
            ("weights",),
            lambda: {
                ("kept",): float(versions.kept_samples),
                ("live",): float(versions.live_samples),
                ("missed",): float(versions.missed_samples),
            },
        )
        backend = self.runtime.backend
        self.metrics.counter_from(
            "agora_worker_stale_gradients_dropped_samples_total",
            "Backward samples whose weight gradient was dropped: their forward ran before this "
            "worker's last optimizer step (optimizer.stale_gradients = drop).",
            (),
            lambda: {(): float(backend.dropped_samples)},
        )
        self._dropped_logged = 0  # backend.dropped_samples as of the last step's log line
        self._m_resyncs = self.metrics.counter(
            "agora_worker_resyncs_total",
            "Times the worker sent itself back to weight sync: a step refused for an update far "
            "beyond the recent ones, or a joiner's first serving round far from its peers'.",
            ["cause"],
        )
        for cause in ("step_refused", "join_probation"):  # exported at 0 from the start
            self._m_resyncs.labels(cause=cause)
        # --- checkpoints (--checkpoint-dir, --resume) -------------------------------------------
        self.checkpoint_writer = (
            CheckpointWriter(
                CheckpointStore(self.settings.checkpoint_dir, run=run, stage=stage, keep=run.checkpoint.keep),
                capture=lambda: self.runtime.call(self.state.capture),
                every_steps=run.checkpoint.every_steps,
                metrics=self.metrics,
                # what the export weighs: a replica that served through a round agrees with its stage
                standing=lambda: {"phase": str(self.phases.phase), "serving_rounds": self.serving_rounds},
            )
            if self.settings.checkpoint_dir
            else None
        )
        # Self-termination: [termination] rules over the signals above; when one trips, the
        # worker withdraws, says why in the DHT and sets watchdog.fired (the CLI then exits).
        self.watchdog = watchdog_for(self)
        self.injection_watch = watcher_for(self)  # the operator's records, read from the DHT

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> str:
        """Serve, join the DHT, take up the stage's state (``Joiner``), wait until admitted (at
        once in an open run), announce, train."""
        self.address = await self.node.start()
        await self.injection_watch.start()  # before joining: a download trigger must be armed
        self.runtime.start()
        self.joined = await self.joiner.join()
        await self.admission.admitted()  # queued meanwhile: the download overlapped the wait
        self.ready = True
        try:
            await self.announcer.announce()  # visible to trainers before the first refresh
        except (DhtError, RpcError) as exc:  # a replica not reached yet: the announcer retries
            log.warning("announce_failed", error=str(exc))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self.progress.run(), name="worker-progress"),
            loop.create_task(self.announcer.run(), name="worker-announce"),
            loop.create_task(self.watchdog.run(), name="worker-watchdog"),
            loop.create_task(
                self.admission.run(revocations_every_s=self.settings.announce_interval_s),
                name="worker-credential",
            ),
        ]
        log.info(
            "worker_started",
            stage=self.stage,
            role=self.role,
            address=self.address,
            device=str(self.device),
            max_batch=self.max_batch,
            phase=self.phases.phase,
            state_source=self.joined.source,
            step=self.optimizer.step,
        )
        return self.address

    async def stop(self, *, grace_s: float | None = None) -> None:
        """Withdraw, leave the DHT, finish in-flight requests (up to ``grace_s``), stop."""
        grace_s = self.settings.shutdown_grace_s if grace_s is None else grace_s
        await self.injection_watch.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.admission.close()
        await self.averager.stop()
        self.donor.close()
        await self.announcer.withdraw()
        await self.node.stop(grace_s=grace_s)  # in-flight requests finish before it returns
        if self.checkpoint_writer is not None:  # the last state, while the compute thread runs
            await self.checkpoint_writer.close(step=self.optimizer.step, timeout_s=grace_s)
        await world.offload(self.runtime.stop)
        log.info("worker_stopped", stage=self.stage, step=self.optimizer.step)

    # --- stepping and describing -------------------------------------------------------------------

    async def take_step(self) -> StepReport:
        # In optimizer sync the step warms AdamW's moments on the live gradients and leaves the
        # weights to averaging: the joiner's own samples never reach them (its moments may still
        # be those of the download, stale from weight sync).
        warmup = self.phases.phase is Phase.OPTIMIZER_SYNC
        backend = self.runtime.backend
        versions = backend.versions

        def step() -> tuple[StepReport, list[tuple[int, int]], int]:  # its backwards' staleness too
            return self.optimizer.apply(warmup=warmup), versions.take_staleness(), backend.dropped_samples

        report, staleness, dropped_total = await asyncio.wrap_future(self.runtime.call(step))
        dropped, self._dropped_logged = dropped_total - self._dropped_logged, dropped_total
        for steps, samples in staleness:
            for _ in range(samples):
                self._m_staleness.observe(steps)
        stale = sum(steps * samples for steps, samples in staleness)
        counted = sum(samples for _, samples in staleness)
        self.last_step = report
        self._m_step.set(report.step)
        self._m_norm.set(report.grad_norm)
        self._m_lr.set(report.lr)
        stage_step = self.progress.stage_step
        if report.refused:
            self._resync("step_refused", report.refused)
        else:
            self.phases.advance(report.step, stage_step=stage_step)
        if report.step >= stage_step:  # catching up: the stage held these rounds already
            self.averager.on_step(report.step)
        if self.checkpoint_writer is not None:
            self.checkpoint_writer.on_step(report.step)
        log.info(
            "optimizer_step",
            stage=self.stage,
            step=report.step,
            samples=report.samples,
            grad_norm=round(report.grad_norm, 4),
            lr=report.lr,
            applied=report.applied,
            warmup=report.warmup,
            update_ratio=round(report.update_ratio, 4),
            seconds=round(report.seconds, 4),
            # steps between its backwards' forwards and themselves: mean and most
            staleness=round(stale / counted, 3) if counted else None,
            staleness_max=max((steps for steps, _ in staleness), default=None),
            stale_dropped=dropped,  # of its samples, those whose stale weight gradient was dropped
        )
        return report

    async def _resume_from_checkpoint(self, *, live_replicas: bool) -> int | None:
        """Install the newest valid checkpoint (weights, AdamW state, step) on the compute thread
        and return its step, when resuming or when the stage has no live replica; else None."""
        writer = self.checkpoint_writer
        if writer is None or (live_replicas and not self.settings.resume):
            return None
        snapshot = await world.offload(writer.store.newest_valid, check=self.state.check)
        if snapshot is None:
            log.warning("checkpoint_resume_none", directory=str(writer.store.directory), stage=self.stage)
            return None
        await asyncio.wrap_future(self.runtime.call(lambda: self.state.install(snapshot)))
        writer.resumed(snapshot.step)
        log.info(
            "checkpoint_resumed", stage=self.stage, step=snapshot.step, directory=str(writer.store.directory)
        )
        return snapshot.step

    def _on_round(self, report: RoundReport) -> None:
        serving = self.phases.phase is Phase.SERVING
        if serving and report.group_size >= 2 and report.averaging_success > 0:
            self.serving_rounds += 1
        self.probation.on_round(report, serving=serving)

    def _resync(self, cause: str, reason: str) -> None:
        """Back to weight sync, where the stage's average replaces this replica's weights."""
        self._m_resyncs.labels(cause=cause).inc()
        log.warning("worker_resync", stage=self.stage, step=self.optimizer.step, cause=cause, reason=reason)
        self.phases.start_sync(self.optimizer.step, reason=f"{cause}: {reason}")

    def _set_phase_metric(self, phase: Phase) -> None:
        for each in Phase:
            self._m_phase.labels(phase=each.value).set(1.0 if each is phase else 0.0)

    def _phase_changed(self, phase: Phase) -> None:
        """Tell trainers and peers at once, not at the next refresh."""
        previous, self._phase_seen = self._phase_seen, phase
        self.serving_rounds = 0
        if phase is Phase.SERVING and previous in (Phase.WEIGHT_SYNC, Phase.OPTIMIZER_SYNC):
            self.probation.joined()
        elif phase is not Phase.SERVING:
            self.probation.left()
        self._set_phase_metric(phase)
        if self.address is None or not self._tasks:
            return  # not started yet: start() announces
        task = asyncio.get_running_loop().create_task(self.announcer.announce())
        self._announcing.add(task)
        task.add_done_callback(self._announcing.discard)

    def describe(self) -> WorkerAnnouncement:
        runtime = self.runtime
        throughput = runtime.samples_processed / runtime.compute_seconds if runtime.compute_seconds else 0.0
        return WorkerAnnouncement(
            node_id=self.key.node_id,
            address=self.address or "",
            stage=self.stage,
            phase=self.phases.phase,
            throughput=throughput,
            load=runtime.queued_samples,
            max_batch=self.max_batch,
            version=__version__,
        )

    # --- operators, tools and peers ------------------------------------------------------------

    def _on_info(self, request: Request) -> Payload:
        return Payload(worker_info(self))

    async def _on_parameters(self, request: Request) -> Payload:
        """The stage's averaged parameters as one float32 vector (or one segment of it):
        for tests, and for tools that measure how far replicas drifted apart."""
        segment = request.meta.get("segment") if isinstance(request.meta, dict) else None
        layout = self.averager.layout
        if segment is not None and (not isinstance(segment, int) or not 0 <= segment < layout.segments):
            raise BadRequest(f"segment must be an int in [0, {layout.segments})")
        ranges = [(0, layout.total)] if segment is None else layout.ranges(segment)
        values = await asyncio.wrap_future(self.runtime.call(lambda: self.averager.flat.read(ranges)))
        return Payload(
            {"step": self.optimizer.step, "total_samples": self.optimizer.total_samples}, {"values": values}
        )

    def _on_poke(self, request: Request) -> Payload:
        """A worker of this stage pushed its (step, samples), or only asks this one to look."""
        self.progress.on_poke(request.meta, request.sender)
        return Payload()

    async def _on_start_round(self, request: Request) -> Payload:
        """Run averaging round ``round`` now (operators and tests; normally steps trigger it)."""
        round_index = request.meta.get("round") if isinstance(request.meta, dict) else None
        if not isinstance(round_index, int) or round_index < 0:
            raise BadRequest("averaging.start needs {'round': n >= 0}")
        report = await self.averager.run_round(round_index)
        return Payload(dataclasses.asdict(report))
