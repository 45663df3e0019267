"""AsyncSPARTA: replicas of a stage average a rotating 1/P of their weights in the background.

Every ``cadence_steps`` optimizer steps a round starts: it snapshots its segment (theta*) on
the compute thread, forms a group through the DHT, runs the butterfly all-reduce while
training continues, and applies the delta rule: theta[I] += (average - theta*[I]) under the
optimizer's lock, so progress made during the round is kept. Optimizer state never travels.
Rounds are robust to lying peers (:mod:`.robust`); what was clipped is kept as evidence, and
a peer clipped round after round is accused in the DHT (:mod:`.accusing`).
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from agora_core import world
from agora_core.admission.accusations import accusations_key
from agora_core.config.run import AveragingConfig
from agora_core.contract import Phase
from agora_core.dht import DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.injection import NO_INJECTIONS, InjectionPoints
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient, RpcServer
from agora_core.schema import WorkerAnnouncement, averaging_summary_key, parse_entries, stage_workers_key
from agora_worker.averaging.accusing import Accuser
from agora_worker.averaging.allreduce import ReductionBoard, RoundGuard, all_reduce
from agora_worker.averaging.matchmaking import Matchmaker, Peer
from agora_worker.averaging.robust import Clipped, DriftHistory, weight_cap
from agora_worker.averaging.segments import FlatParameters, SegmentLayout
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.runtime import Runtime

log = get_logger("worker.averaging")

EVIDENCE_KEPT = 1024  # clipped contributions remembered, newest last
# A declared weight is accused past this many rounds of the whole stage's samples: more than
# any honest peer gathers between its rounds, however slow the reducer it outweighs.
WEIGHT_ACCUSED_ROUNDS = 8


@dataclass(frozen=True)
class RoundReport:
    round: int
    segment: int
    group_size: int
    reduce_success: float  # of the inputs this peer's reducers expected, the fraction received
    averaging_success: float  # of this peer's segment, the fraction whose average came back
    seconds: float
    bytes_moved: int  # tensor bytes streamed to and from other peers
    excluded: bool = False  # this peer formed a group the reducers did not share
    steps_during: int = 0  # optimizer steps this peer took while the round ran (kept: delta rule)
    matchmaking_failed: bool = False  # no group could be formed (not: this peer was alone)
    reducers: int = 0  # reducers in the group (none: nobody could average)
    allreduce_s: float = 0.0  # of ``seconds``, the exchange (and applying it) once the group formed
    # ||average - own|| / ||own|| over the part of its segment that was averaged: how far this
    # replica stood from its group (a replica its stage does not recognise stands far off)
    distance: float = 0.0
    clipped: int = 0  # contributions this peer clipped (as reducer) or bounded (as sender)


class Averager:
    def __init__(
        self,
        *,
        config: AveragingConfig,
        chunk_bytes: int,  # [transport] chunk_bytes: one averaging chunk per wire chunk
        record_ttl_s: float,  # [dht] record_ttl_s: how long its matchmaking entries and summaries live
        target_batch_size: int,  # [optimizer]'s: with cadence_steps, a round's samples (weight cap)
        run_name: str,
        seed: int,
        stage: int,
        key: NodeKey,
        dht: DhtNode,
        server: RpcServer,
        client: RpcClient,
        runtime: Runtime,
        optimizer: HostOptimizer,
        tensors: list,
        metrics: NodeMetrics,
        address: Callable[[], str],
        phase: Callable[[], Phase],
        injections: InjectionPoints = NO_INJECTIONS,  # the operator's averaging-send trigger
        on_round: Callable[[RoundReport], None] | None = None,  # after every round, with its report
    ):
        self.config = config
        self._target_batch_size = target_batch_size
        self._injections = injections
        self.guard = RoundGuard(
            reducing=DriftHistory(multiplier=config.clip_multiplier, rounds=config.clip_history_rounds),
            receiving=DriftHistory(multiplier=config.clip_multiplier, rounds=config.clip_history_rounds),
        )
        self.evidence: collections.deque[Clipped] = collections.deque(maxlen=EVIDENCE_KEPT)
        self.accuser = Accuser(
            node_id=key.node_id,
            stage=stage,
            after_rounds=config.accuse_after_rounds,
            window_rounds=config.accuse_window_rounds,
            weight_limit=WEIGHT_ACCUSED_ROUNDS * config.cadence_steps * target_batch_size,
        )
        self._accusations = OwnedEntry(dht, key, accusations_key(run_name))
        self.chunk_values = max(1, chunk_bytes // 4)  # float32 values per streamed chunk
        self._run_name, self._stage, self._key = run_name, stage, key
        self._dht, self._client = dht, client
        self._runtime, self._optimizer = runtime, optimizer
        self._address, self._phase = address, phase
        self._on_round = on_round
        self.flat = FlatParameters(tensors)
        self.layout = SegmentLayout(
            [t.numel() for t in tensors], segments=config.segments, run_seed=seed, stage=stage
        )
        self.matchmaker = Matchmaker(
            dht=dht, key=key, run_name=run_name, stage=stage, ttl_s=record_ttl_s, reduces=self.reduces
        )
        self._record_ttl_s = record_ttl_s
        # Senders may reach this peer before it formed its group: they wait up to one window.
        # Streams get the RPC node's window and compression ([transport]).
        self.board = ReductionBoard(server, early_wait_s=config.matchmaking_window_s + 5.0, stage=stage)
        self._last_round_samples = 0
        self.active_round: int | None = None
        self.active_group_size: int | None = None  # once the running round's group is formed
        self._task: asyncio.Task | None = None
        self.reports: list[RoundReport] = []
        self._publishing: set[asyncio.Task] = set()
        self._summary = OwnedEntry(dht, key, averaging_summary_key(run_name, stage))
        self._m_group = metrics.gauge("agora_averaging_group_size", "Peers in the last averaging round.")
        self._m_reduce = metrics.gauge(
            "agora_averaging_reduce_success", "Last round: inputs reducers received."
        )
        self._m_average = metrics.gauge(
            "agora_averaging_success", "Last round: fraction of the segment averaged."
        )
        self._m_seconds = metrics.histogram(
            "agora_averaging_round_seconds",
            "Averaging round duration.",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 150, 300),
        )
        self._m_bytes = metrics.counter("agora_averaging_bytes_total", "Bytes this peer streamed in rounds.")
        self._m_clipped = metrics.counter(
            "agora_averaging_clipped_total",
            "Contributions cut down: a sender's chunk clipped here, or a reducer's difference bounded.",
            ["peer_role"],
        )
        self._m_accused = metrics.counter(
            "agora_averaging_accusations_total",
            "Peers this one accused in the DHT, by what they did.",
            ["kind"],
        )

    def reduces(self, node_id: str) -> bool:
        """Whether the run config lets ``node_id`` reduce (every member derives it alike)."""
        return self.config.reducers == "all" or node_id in self.config.reducer_ids

    @property
    def reducer_eligible(self) -> bool:
        return self.reduces(self._key.node_id)

    # --- triggering ------------------------------------------------------------------------------

    def on_step(self, step: int) -> None:
        """Called after every optimizer step: start a round every ``cadence_steps`` steps."""
        if not self.config.enabled or step % self.config.cadence_steps:
            return
        if self._task is not None and not self._task.done():
            log.warning("averaging_round_skipped", step=step, reason="the previous round is still running")
            return
        self._task = asyncio.get_running_loop().create_task(self.run_round(step // self.config.cadence_steps))

    @property
    def round_task(self) -> asyncio.Task | None:
        """The round the cadence started, while it runs (None otherwise)."""
        return self._task if self._task is not None and not self._task.done() else None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    # --- a round ----------------------------------------------------------------------------------

    async def _expected_peers(self) -> set[str]:
        found = await self._dht.get(stage_workers_key(self._run_name, self._stage))
        announced = parse_entries(found, WorkerAnnouncement.from_value)
        return {self._key.node_id} | {a.node_id for a in announced if a.phase.averages}

    def info(self) -> dict:
        """Where the running round stands (for worker.info: operators, tools and tests)."""
        reductions = self.board.running()
        return {
            "active_round": self.active_round,
            "group_size": self.active_group_size,
            "reduced_chunks": sum(len(r.chunks) - len(r.pending) for r in reductions),
            "heard_from": sorted({s for r in reductions for s in r.heard_from}),
            "rounds": len(self.reports),
            "last": asdict(self.reports[-1]) if self.reports else None,
            # evidence kept: peer -> contributions of it clipped here (as sender or reducer)
            "clipped": dict(collections.Counter(c.peer for c in self.evidence)),
            "accused": self.accuser.info(),  # peer -> the kinds this peer accuses it of
        }

    async def run_round(self, round_index: int) -> RoundReport:
        self.active_round = round_index
        try:
            return await self._run_round(round_index)
        finally:
            self.active_round = self.active_group_size = None

    async def _run_round(self, round_index: int) -> RoundReport:
        started = world.monotonic()
        deadline = started + self.config.round_timeout_s
        segment = round_index % self.config.segments
        ranges = self.layout.ranges(segment)
        snapshot, samples, step = await asyncio.wrap_future(
            self._runtime.call(
                lambda: (self.flat.read(ranges), self._optimizer.total_samples, self._optimizer.step)
            )
        )
        # Syncing joiners take the average without moving it (ARCHITECTURE §8).
        phase = self._phase()
        weight = float(samples - self._last_round_samples) if phase.counts_samples else 0.0
        self._last_round_samples = samples
        me = Peer(
            node_id=self._key.node_id,
            address=self._address(),
            weight=weight,
            reducer=self.reducer_eligible,
            phase=phase,
        )
        try:
            group = await self.matchmaker.form_group(
                round_index,
                me,
                expected=await self._expected_peers(),
                window_s=self.config.matchmaking_window_s,
            )
        except Exception as exc:  # no group, no round: keep local weights
            log.warning("averaging_matchmaking_failed", round=round_index, error=str(exc))
            return self._finish(
                RoundReport(
                    round_index, segment, 1, 0.0, 0.0, world.monotonic() - started, 0, matchmaking_failed=True
                )
            )
        if len(group.members) < 2 or not group.reducers:
            return self._finish(
                RoundReport(
                    round_index,
                    segment,
                    len(group.members),
                    1.0,
                    0.0,
                    world.monotonic() - started,
                    0,
                    reducers=len(group.reducers),
                )
            )
        self.active_group_size = len(group.members)
        formed = world.monotonic()
        self.guard.segment = segment
        self.guard.weight_cap = weight_cap(
            own=weight,
            members=len(group.members),
            cadence_steps=self.config.cadence_steps,
            target_batch_size=self._target_batch_size,
            ratio=self.config.weight_ratio,
        )
        result = await all_reduce(
            board=self.board,
            client=self._client,
            group=group,
            me=me.node_id,
            values=snapshot,
            chunk_values=self.chunk_values,
            chunk_timeout_s=self.config.chunk_timeout_s,
            deadline=deadline,
            injections=self._injections,
            guard=self.guard,
        )
        self.guard.close_round()
        self._keep_evidence(result.evidence)
        self._accuse(round_index, result.evidence)
        applied_at, distance = await asyncio.wrap_future(
            self._runtime.call(lambda: self._apply(ranges, result.pieces, snapshot))
        )
        report = RoundReport(
            round=round_index,
            segment=segment,
            group_size=len(group.members),
            reduce_success=result.reduce_success,
            averaging_success=result.averaged_fraction,
            seconds=world.monotonic() - started,
            bytes_moved=result.wire_bytes,
            excluded=result.excluded,
            steps_during=applied_at - step,
            reducers=len(group.reducers),
            allreduce_s=world.monotonic() - formed,
            distance=distance,
            clipped=len(result.evidence),
        )
        return self._finish(report)

    def _keep_evidence(self, evidence: list[Clipped]) -> None:
        if not evidence:
            return
        self.evidence.extend(evidence)
        for clipped in evidence:
            self._m_clipped.labels(peer_role=clipped.role).inc()
        worst = max(evidence, key=lambda c: c.rms / c.radius if c.radius else float("inf"))
        log.warning(
            "averaging_clipped",
            round=worst.round,
            count=len(evidence),
            peers=sorted({c.peer[:12] for c in evidence}),
            worst_peer=worst.peer[:12],
            worst_rms=worst.rms,
            radius=worst.radius,
        )

    def _accuse(self, round_index: int, evidence: list[Clipped]) -> None:
        for peer, kind in self.accuser.observe(round_index, evidence):
            self._m_accused.labels(kind=kind).inc()
            log.warning("averaging_accused", round=round_index, peer=peer, kind=kind)

    def _apply(self, ranges, pieces: list[tuple[int, np.ndarray]], snapshot: np.ndarray) -> tuple[int, float]:
        """The delta rule, on the compute thread, under the optimizer's lock; returns the step
        it landed at and the relative distance of ``snapshot`` (theta*) from the average.

        Each piece is (start in the segment, average - theta*) of a chunk whose average came
        back; the values of chunks that did not come back keep their local progress. Gradients
        accumulated toward the next step stay: the step applies them to the averaged weights.
        """
        with self._optimizer.writing_masters():  # the device copy follows in one transfer
            self.flat.add(ranges, pieces)
        moved = sum(float(np.dot(d, d)) for _, d in pieces)
        held = sum(float(np.dot(v, v)) for v in (snapshot[start : start + len(d)] for start, d in pieces))
        return self._optimizer.step, math.sqrt(moved / held) if held > 0 else 0.0

    def _finish(self, report: RoundReport) -> RoundReport:
        self.reports.append(report)
        self._m_group.set(report.group_size)
        self._m_reduce.set(report.reduce_success)
        self._m_average.set(report.averaging_success)
        self._m_seconds.observe(report.seconds)
        self._m_bytes.inc(report.bytes_moved)
        log.info("averaging_round", **asdict(report))
        if self._on_round is not None:
            self._on_round(report)
        task = asyncio.get_running_loop().create_task(self._publish(report))
        self._publishing.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._publishing.discard)
        return report

    async def peer_summaries(self) -> list[dict]:
        """The stage's other workers' latest round reports, as they published them (their own
        word: each field is to be checked where it is used)."""
        found = await self._summary.read_all()
        return [v.value for k, v in found.items() if k != self._summary.subkey and isinstance(v.value, dict)]

    async def _publish(self, report: RoundReport) -> None:
        """The round's summary, and the standing accusations (every round, so they outlive
        their record's lifetime while this worker runs)."""
        try:
            await self._summary.publish(asdict(report), self._record_ttl_s)
            accusations = self.accuser.record()
            if accusations is not None:
                await self._accusations.publish(accusations.to_value(), self._record_ttl_s)
        except Exception as exc:  # bookkeeping only: the round itself is done
            log.info("averaging_summary_unpublished", error=str(exc))
