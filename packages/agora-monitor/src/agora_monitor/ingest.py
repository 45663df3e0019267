"""From one snapshot to the rows the database keeps: totals, node states, flags.

:func:`ingest` folds a :class:`~.snapshot.Snapshot` into the run's :class:`~.ledger.Ledger`
and node states, and returns what to write (:class:`Rows`). It judges as it goes:

* ``impossible_rate``: a worker whose samples grew faster than its own announced throughput
  allows (times ``rate_slack``, plus one microbatch), or a trainer faster than the pipeline
  can carry (the slowest stage's summed throughput, times ``rate_slack``, plus its lanes);
* ``samples_mismatch``: a stage whose deduplicated samples and the trainers' total differ
  by more than ``reconcile_tolerance`` of the trainers' total plus ``reconcile_batches``
  target batches. Every sample passes every stage, so they should agree.

Pure: no I/O, so the rules are tested on constructed snapshots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from agora_core.config import RunConfig
from agora_core.contract import Phase
from agora_monitor.ledger import (
    Ledger,
    ReceiptCounter,
    StageCounter,
    TrainerCounter,
    WorkerCounter,
    advance_stage,
    receipt_added,
    trainer_delta,
    worker_delta,
)
from agora_monitor.records import Flag
from agora_monitor.settings import MonitorSettings
from agora_monitor.snapshot import Snapshot


@dataclass
class Rows:
    snapshot: dict
    stage_snapshots: list[dict] = field(default_factory=list)
    stages: list[dict] = field(default_factory=list)
    worker_steps: list[dict] = field(default_factory=list)
    nodes: list[dict] = field(default_factory=list)  # full rows of every node that changed
    flags: list[Flag] = field(default_factory=list)
    receipts: list[dict] = field(default_factory=list)  # (trainer, worker) rows that changed


def new_node(run: str, node_id: str, role: str, t: float) -> dict:
    """A node row as first seen (the ``nodes`` table's columns)."""
    return {
        "run": run, "node_id": node_id, "role": role, "account": "", "stage": None, "phase": None,
        "address": None, "version": None, "throughput": None, "load": None, "step": None,
        "step_samples": None, "samples": 0, "tokens": 0, "reported_samples": None,
        "reported_tokens": None, "restarts": 0, "loss": None, "live": True, "first_seen": t,
        "last_seen": t, "lost_t": None, "left_t": None, "termination_reason": None, "termination_detail": None,
        "terminated_t": None,
    }  # fmt: skip


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class Ingest:
    """The fold of one run's snapshots: its ledger and node rows, owned by one caller."""

    def __init__(self, run: RunConfig, settings: MonitorSettings, ledger: Ledger, nodes: dict[str, dict]):
        self.run = run
        self.settings = settings
        self.ledger = ledger
        self.nodes = nodes  # node id -> its row, as in the database

    def _node(self, node_id: str, role: str, t: float) -> dict:
        row = self.nodes.get(node_id)
        if row is None:
            row = self.nodes[node_id] = new_node(self.run.name, node_id, role, t)
        return row

    def _workers(self, snap: Snapshot, rows: Rows, changed: set[str]) -> dict[int, float]:
        """Announcements and progress into node rows and worker counters; per-stage capacity."""
        capacity: dict[int, float] = {}
        for a in snap.workers:
            row = self._node(a.node_id, "worker", snap.t)
            row.update(
                role="worker", stage=a.stage, phase=a.phase.value, address=a.address, version=a.version
            )
            row.update(throughput=a.throughput, load=a.load)
            if a.phase.visible_to_trainers:
                capacity[a.stage] = capacity.get(a.stage, 0.0) + a.throughput
            changed.add(a.node_id)
        announced = {a.node_id: a for a in snap.workers}
        for stage, reports in snap.progress.items():
            for report in reports:
                counter = self.ledger.workers.get(report.node_id)
                if counter is None or counter.stage != stage:
                    counter = self.ledger.workers[report.node_id] = WorkerCounter(stage=stage)
                first = counter.step < 0
                dt = snap.t - counter.t
                delta = worker_delta(counter, report.step, report.samples)
                counter.t = snap.t
                rows.worker_steps.append(
                    {"run": self.run.name, "stage": stage, "node_id": report.node_id,
                     "step": report.step, "samples": counter.step_samples}
                )  # fmt: skip
                a = announced.get(report.node_id)
                if not first and a is not None and a.throughput > 0 and dt > 0:
                    allowed = a.throughput * self.settings.rate_slack * dt + a.max_batch
                    if delta > allowed:
                        rows.flags.append(Flag(report.node_id, "impossible_rate", (
                            f"stage {stage}: {delta} samples in {dt:.1f} s, announced "
                            f"{a.throughput:.1f} samples/s (at most {allowed:.0f})")))  # fmt: skip
                row = self._node(report.node_id, "worker", snap.t)
                row.update(
                    stage=stage, step=counter.step, step_samples=counter.step_samples, samples=counter.samples
                )
                changed.add(report.node_id)
        return capacity

    def _trainers(
        self, snap: Snapshot, rows: Rows, changed: set[str], capacity: float | None
    ) -> tuple[float | None, int]:
        """Trainer counters into node rows; (the live trainers' mean finite loss, how many are non-finite)."""
        losses, nonfinite = [], 0
        for report in snap.trainers:
            counter = self.ledger.trainers.get(report.node_id)
            first = counter is None
            if first:
                counter = self.ledger.trainers[report.node_id] = TrainerCounter()
            dt = snap.t - counter.t
            restarts = counter.restarts
            delta, _ = trainer_delta(counter, report.samples, report.tokens)
            counter.t = snap.t
            self._receipts(
                snap,
                rows,
                report.node_id,
                report.receipts,
                restarted=counter.restarts > restarts,
                completed=delta,
            )
            if not first and capacity and dt > 0:
                allowed = capacity * self.settings.rate_slack * dt + report.lanes
                if delta > allowed:
                    rows.flags.append(Flag(report.node_id, "impossible_rate", (
                        f"trainer: {delta} samples in {dt:.1f} s, the pipeline carries "
                        f"{capacity:.1f} samples/s (at most {allowed:.0f})")))  # fmt: skip
            row = self._node(report.node_id, "trainer", snap.t)
            loss = report.loss_ema
            finite = loss is not None and math.isfinite(loss)
            row.update(
                role="trainer", samples=counter.samples, tokens=counter.tokens, restarts=counter.restarts
            )
            row.update(
                reported_samples=report.samples, reported_tokens=report.tokens, loss=loss if finite else None
            )
            changed.add(report.node_id)
            if report.node_id in snap.members:
                if finite:
                    losses.append(loss)
                elif loss is not None:
                    nonfinite += 1
        return _mean(losses), nonfinite

    def _account(self, snap: Snapshot, node_id: str) -> str:
        member = snap.members.get(node_id)
        if member is not None:
            return member.account
        row = self.nodes.get(node_id)
        return "" if row is None else row["account"]

    def _receipts(
        self,
        snap: Snapshot,
        rows: Rows,
        trainer: str,
        receipts: dict[str, int],
        *,
        restarted: bool,
        completed: int,
    ) -> None:
        """One trainer's receipts into the (trainer, worker) counters and the workers' credit.
        ``completed``: the samples its report adds; each is one receipt per stage at most, so
        a report whose receipts add more is flagged (``receipts_exceed``) and credits nothing."""
        account = self._account(snap, trainer)
        anchors = self.run.admission.anchor_accounts
        added = []
        for worker, reported in receipts.items():
            counter = self.ledger.receipts.get((trainer, worker))
            if counter is None:
                counter = self.ledger.receipts[trainer, worker] = ReceiptCounter()
            # an open run has no accounts; else a trainer vouches only for another's workers
            # (one whose account is known), unless it is the operator's own
            owner = self._account(snap, worker)
            counter.counts = not account or account in anchors or owner not in ("", account)
            if counter.reported != reported or restarted:
                added.append(
                    (worker, counter, reported, receipt_added(counter, reported, restarted=restarted))
                )
        most = completed * self.run.model.n_stages
        credit = sum(samples for *_, samples in added) <= most
        if not credit:
            rows.flags.append(Flag(trainer, "receipts_exceed", (
                f"receipts for {sum(samples for *_, samples in added)} samples, at most {most} "
                f"({completed} new samples x {self.run.model.n_stages} stages)")))  # fmt: skip
        for worker, counter, reported, samples in added:
            counter.reported = reported
            if credit and counter.counts:
                counter.credited += samples
            rows.receipts.append(
                {"run": self.run.name, "trainer": trainer, "worker": worker, "reported": reported,
                 "credited": counter.credited, "counts": counter.counts, "last_t": snap.t}
            )  # fmt: skip

    def _stages(self, snap: Snapshot, rows: Rows) -> None:
        target = self.run.optimizer.target_batch_size
        trainer_total = self.ledger.samples
        allowed = self.settings.reconcile_tolerance * trainer_total + self.settings.reconcile_batches * target
        for stage in range(self.run.model.n_stages):
            counter = self.ledger.stages.setdefault(stage, StageCounter())
            reports = [(r.node_id, r.step, r.samples) for r in snap.progress.get(stage, [])]
            advance_stage(counter, reports, target, snap.t)
            workers = [a for a in snap.workers if a.stage == stage]
            serving = sum(a.phase is Phase.SERVING for a in workers)
            averaging = snap.averaging.get(stage, [])
            gap = counter.samples - trainer_total
            reconciled = abs(gap) <= allowed or counter.step < 0
            if not reconciled:
                rows.flags.append(Flag(f"stage/{stage}", "samples_mismatch", (
                    f"stage {stage} counts {counter.samples} samples, the trainers {trainer_total} "
                    f"(tolerance {allowed:.0f})")))  # fmt: skip
            step = max(counter.step, 0)
            rows.stages.append(
                {"run": self.run.name, "stage": stage, "step": step, "step_changed_t": counter.step_changed_t or snap.t,
                 "completed_samples": counter.completed_samples, "samples": counter.samples,
                 "workers_serving": serving, "samples_gap": gap, "reconciled": reconciled, "last_t": snap.t}
            )  # fmt: skip
            rows.stage_snapshots.append(
                {"run": self.run.name, "t": snap.t, "stage": stage, "workers_serving": serving,
                 "workers_syncing": len(workers) - serving, "step": step, "samples": counter.samples,
                 "averaging_success": _mean([r["averaging_success"] for r in averaging]),
                 "reduce_success": _mean([r["reduce_success"] for r in averaging])}
            )  # fmt: skip

    def _membership(self, snap: Snapshot, changed: set[str]) -> None:
        """Accounts and roles from credentials; departures; who left cleanly, who without a word."""
        for member in snap.members.values():
            row = self._node(member.node_id, member.role, snap.t)
            if row["role"] not in ("worker", "trainer"):
                row["role"] = member.role
            row.update(account=member.account, address=row["address"] or member.address)
            changed.add(member.node_id)
        for departure in snap.departures:
            row = self._node(departure.node_id, "worker", snap.t)
            if row["terminated_t"] != departure.time:
                row.update(termination_reason=departure.reason.value, terminated_t=departure.time)
                row.update(termination_detail=departure.detail[:1024], stage=departure.stage)
                changed.add(departure.node_id)
        for node_id, row in self.nodes.items():
            if node_id in snap.members:
                row.update(live=True, last_seen=snap.t, lost_t=None, left_t=None)
            elif node_id in snap.left:
                # a clean stop; also after a lost one: its LEFT may reach this member after
                # its failed probes did, and a member's own claim outranks them
                if row["left_t"] is None:
                    row.update(live=False, left_t=snap.t, lost_t=None)
                    changed.add(node_id)
            elif row["live"]:
                row.update(live=False, lost_t=snap.t)
                changed.add(node_id)

    def apply(self, snap: Snapshot, ingest_s: float = 0.0) -> Rows:
        changed: set[str] = set()
        rows = Rows(snapshot={})
        rows.flags += snap.flags
        capacity = self._workers(snap, rows, changed)
        stages = self.run.model.n_stages
        pipeline = min(capacity.get(s, 0.0) for s in range(stages)) if stages else None
        loss, nonfinite = self._trainers(snap, rows, changed, pipeline)
        self._stages(snap, rows)
        self._membership(snap, changed)
        tokens, ledger = self.ledger.tokens, self.ledger
        rate = None
        if ledger.last_t is not None and snap.t > ledger.last_t:
            rate = (tokens - ledger.last_tokens) / (snap.t - ledger.last_t)
        ledger.last_t, ledger.last_tokens = snap.t, tokens
        rows.snapshot = {
            "run": self.run.name, "t": snap.t, "workers": len(snap.workers),
            "trainers": sum(t.node_id in snap.members for t in snap.trainers), "samples": ledger.samples,
            "tokens": tokens, "tokens_per_s": rate, "loss": loss, "nonfinite_losses": nonfinite,
            "ingest_s": ingest_s,
        }  # fmt: skip
        rows.nodes = [self.nodes[node_id] for node_id in sorted(changed)]
        return rows
