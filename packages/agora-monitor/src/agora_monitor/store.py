"""The monitor's database: writing each snapshot's rows, and restoring the ledger from them.

One write transaction per snapshot, committed before the next read of the DHT: a monitor
killed between two snapshots loses at most the one it was reading, and its successor
(:meth:`MonitorStore.restore`) continues the same totals. Rows go in as batched
executemany upserts, a few statements per snapshot whatever the number of nodes.
"""

from __future__ import annotations

from sqlalchemy import case, insert, select, update

from agora_core.config import RunConfig
from agora_core.node.sql import SqlDatabase
from agora_monitor import rollup, schema
from agora_monitor.errors import MonitorDatabaseError
from agora_monitor.ingest import Rows
from agora_monitor.ledger import Ledger, ReceiptCounter, StageCounter, TrainerCounter, WorkerCounter

UPDATED_NODE_COLUMNS = [
    c.name for c in schema.nodes.columns if c.name not in ("run", "node_id", "first_seen")
]


class MonitorStore(SqlDatabase):
    """The monitor's tables on one database, SQLite or PostgreSQL (see :mod:`agora_core.node.sql`)."""

    def __init__(self, url: str) -> None:
        super().__init__(
            url,
            metadata=schema.metadata,
            schema_info=schema.schema_info,
            schema_version=schema.SCHEMA_VERSION,
            what="monitor",
            error=MonitorDatabaseError,
            driver_hint="pip install 'agora-monitor[postgresql]'",
            upgrades_from=schema.UPGRADES_FROM,
        )

    def __enter__(self) -> MonitorStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing -------------------------------------------------------------------------------

    def ensure_run(self, run: RunConfig, t: float) -> None:
        """The run's row: created at its first snapshot, its last time moved by every one."""
        values = {
            "run": run.name,
            "n_stages": run.model.n_stages,
            "target_batch_size": run.optimizer.target_batch_size,
            "seq_len": run.model.seq_len,
            "first_t": t,
            "last_t": t,
        }
        statement = self.upsert(schema.runs).values(values)
        statement = statement.on_conflict_do_update(
            index_elements=["run"],
            set_={"n_stages": values["n_stages"], "target_batch_size": values["target_batch_size"]},
        )
        with self.transaction(write=True) as connection:
            connection.execute(statement)

    def write(self, rows: Rows) -> int:
        """Every row of one snapshot, in one transaction; returns the snapshot's id."""
        run, t = rows.snapshot["run"], rows.snapshot["t"]
        with self.transaction(write=True) as connection:
            snapshot_id = connection.execute(
                insert(schema.snapshots).values(rows.snapshot).returning(schema.snapshots.c.id)
            ).scalar_one()
            connection.execute(update(schema.runs).where(schema.runs.c.run == run).values(last_t=t))
            if rows.stage_snapshots:
                stage_rows = [{**row, "snapshot_id": snapshot_id} for row in rows.stage_snapshots]
                connection.execute(insert(schema.stage_snapshots), stage_rows)
            rollup.write(connection, self.upsert, rows.snapshot, rows.stage_snapshots)
            if rows.stages:
                statement = self.upsert(schema.stages)
                columns = [c for c in rows.stages[0] if c not in ("run", "stage")]
                statement = statement.on_conflict_do_update(
                    index_elements=["run", "stage"], set_={c: statement.excluded[c] for c in columns}
                )
                connection.execute(statement, rows.stages)
            if rows.worker_steps:
                statement = self.upsert(schema.worker_steps)
                held, seen = schema.worker_steps.c.samples, statement.excluded.samples
                statement = statement.on_conflict_do_update(
                    index_elements=["run", "stage", "node_id", "step"],
                    set_={"samples": case((seen > held, seen), else_=held)},  # the most ever seen
                )
                connection.execute(statement, rows.worker_steps)
            if rows.nodes:
                statement = self.upsert(schema.nodes)
                statement = statement.on_conflict_do_update(
                    index_elements=["run", "node_id"],
                    set_={c: statement.excluded[c] for c in UPDATED_NODE_COLUMNS},
                )
                connection.execute(statement, rows.nodes)
            if rows.receipts:
                statement = self.upsert(schema.receipts)
                columns = ("reported", "credited", "counts", "last_t")
                statement = statement.on_conflict_do_update(
                    index_elements=["run", "trainer", "worker"],
                    set_={c: statement.excluded[c] for c in columns},
                )
                connection.execute(statement, rows.receipts)
            if rows.flags:
                self._write_flags(connection, run, t, rows)
        return snapshot_id

    def rebuild_rollup(self, run_name: str) -> None:
        """Run ``run_name``'s per-minute rollup recomputed from its raw snapshot rows (for
        history written without it; :meth:`write` keeps it current)."""
        with self.transaction(write=True) as connection:
            rollup.rebuild(connection, self.backend, run_name)

    def _write_flags(self, connection, run: str, t: float, rows: Rows) -> None:
        merged: dict[tuple[str, str], dict] = {}
        for flag in rows.flags:
            key = (flag.subject[:64], flag.kind)
            entry = merged.setdefault(key, {"run": run, "subject": key[0], "kind": flag.kind, "count": 0})
            entry.update(detail=flag.detail[:500], first_t=t, last_t=t, count=entry["count"] + 1)
        statement = self.upsert(schema.flags)
        statement = statement.on_conflict_do_update(
            index_elements=["run", "subject", "kind"],
            set_={
                "count": schema.flags.c.count + statement.excluded["count"],
                "detail": statement.excluded.detail,
                "last_t": statement.excluded.last_t,
            },
        )
        connection.execute(statement, list(merged.values()))

    # --- restoring -----------------------------------------------------------------------------

    def restore(self, run_name: str) -> tuple[Ledger, dict[str, dict]]:
        """The ledger and node rows of run ``run_name`` as the last snapshot left them."""
        ledger, nodes = Ledger(), {}
        with self.transaction() as connection:
            for row in connection.execute(
                select(schema.nodes).where(schema.nodes.c.run == run_name)
            ).mappings():
                nodes[row["node_id"]] = dict(row)
                if row["role"] == "worker" and row["step"] is not None and row["stage"] is not None:
                    ledger.workers[row["node_id"]] = WorkerCounter(
                        stage=row["stage"], step=row["step"], step_samples=row["step_samples"] or 0,
                        samples=row["samples"], t=row["last_seen"],
                    )  # fmt: skip
                elif row["role"] == "trainer" and row["reported_samples"] is not None:
                    ledger.trainers[row["node_id"]] = TrainerCounter(
                        reported_samples=row["reported_samples"], reported_tokens=row["reported_tokens"] or 0,
                        samples=row["samples"], tokens=row["tokens"], restarts=row["restarts"], t=row["last_seen"],
                    )  # fmt: skip
            stages = connection.execute(
                select(schema.stages).where(schema.stages.c.run == run_name)
            ).mappings()
            for row in stages:
                ledger.stages[row["stage"]] = StageCounter(
                    step=row["step"],
                    step_changed_t=row["step_changed_t"],
                    completed_samples=row["completed_samples"],
                )
            steps = schema.worker_steps
            for stage, counter in ledger.stages.items():
                held = connection.execute(
                    select(steps.c.node_id, steps.c.step, steps.c.samples).where(
                        steps.c.run == run_name, steps.c.stage == stage, steps.c.step >= counter.step
                    )
                )
                for node_id, step, samples in held:
                    counter.at_step.setdefault(step, {})[node_id] = samples
            r = schema.receipts
            for row in connection.execute(select(r).where(r.c.run == run_name)).mappings():
                ledger.receipts[row["trainer"], row["worker"]] = ReceiptCounter(
                    reported=row["reported"], credited=row["credited"], counts=row["counts"]
                )
            last = connection.execute(
                select(schema.snapshots.c.t, schema.snapshots.c.tokens)
                .where(schema.snapshots.c.run == run_name)
                .order_by(schema.snapshots.c.t.desc())
                .limit(1)
            ).first()
            if last is not None:
                ledger.last_t, ledger.last_tokens = last
        return ledger, nodes
