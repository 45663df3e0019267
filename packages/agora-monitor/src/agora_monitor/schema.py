"""The monitor's tables, defined once for SQLite and PostgreSQL (SQLAlchemy Core).

Every table carries the run's name: one database holds the history of several runs. Times
are wall-clock seconds in double precision.

* ``snapshots``, ``stage_snapshots``: one row per snapshot (and per stage of it) — the time
  series the dashboard draws. Append-only.
* ``stages``, ``nodes``: the current state of each stage and node, upserted every snapshot,
  with the running totals (deduplicated samples) that survive a monitor restart.
* ``worker_steps``: the deduplication ledger: a worker's samples toward one optimizer step
  of its stage, ``(run, stage, node_id, step)`` -> the most it ever reported. Replicas of a
  stage hold distinct samples at one step, so summing over workers does not double count;
  seeing a report again (a repeated snapshot, a restarted worker's lingering record, a
  restarted monitor) only keeps the maximum.
* ``series_minutes``, ``stage_series_minutes``: the time series rolled up per wall-clock
  minute (sums and counts for means, extremes for the rest), upserted by every snapshot in
  its own transaction (:mod:`.rollup`): the dashboard's long windows read these, a row a
  minute instead of twelve.
* ``flags``: records the monitor distrusts (bad writer, impossible rate, unreconciled
  samples), one row per (run, subject, kind) with a count, so a persistent fault is one row.
* ``receipts``: per (trainer, worker), the trainer's signed count of the worker's samples as
  last read, and the samples credited to the worker from it (:mod:`.ledger`): what the
  leaderboard counts for workers.

Bump :data:`SCHEMA_VERSION` with any change: a monitor refuses a database of another version,
except one of :data:`UPGRADES_FROM`, which lacks only tables added since (created on opening).
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
)

SCHEMA_VERSION = 3  # 2: the per-minute rollups; nodes.left_t. 3: receipts
UPGRADES_FROM = (2,)  # versions whose databases lack only tables added since
RUN = 200  # a run name's length bound
NODE_ID = 64  # node ids are 40 hex digits; flags' subjects ("stage/3") fit too

metadata = MetaData()

schema_info = Table(
    "schema_info", metadata, Column("version", Integer, primary_key=True, autoincrement=False)
)

runs = Table(
    "runs",
    metadata,
    Column("run", String(RUN), primary_key=True),
    Column("n_stages", Integer, nullable=False),
    Column("target_batch_size", Integer, nullable=False),
    Column("seq_len", Integer, nullable=False),
    Column("first_t", Double, nullable=False),
    Column("last_t", Double, nullable=False),
)

snapshots = Table(
    "snapshots",
    metadata,
    # BigInteger on PostgreSQL (a long run at 5 s adds up); SQLite's rowid needs INTEGER
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("run", String(RUN), ForeignKey("runs.run"), nullable=False),
    Column("t", Double, nullable=False),
    Column("workers", Integer, nullable=False),  # live workers, every phase
    Column("trainers", Integer, nullable=False),
    Column("samples", BigInteger, nullable=False),  # trainers' completed samples, deduplicated
    Column("tokens", BigInteger, nullable=False),
    Column("tokens_per_s", Double),  # since the previous snapshot (None for the first)
    Column("loss", Double),  # mean of the live trainers' finite loss EMAs
    Column("nonfinite_losses", Integer, nullable=False),  # trainers reporting NaN or inf
    Column("ingest_s", Double, nullable=False),  # how long reading and writing it took
)
Index("snapshots_by_run_time", snapshots.c.run, snapshots.c.t)

stage_snapshots = Table(
    "stage_snapshots",
    metadata,
    Column("snapshot_id", BigInteger().with_variant(Integer, "sqlite"), ForeignKey("snapshots.id")),
    Column("run", String(RUN), nullable=False),
    Column("t", Double, nullable=False),
    Column("stage", Integer, nullable=False),
    Column("workers_serving", Integer, nullable=False),
    Column("workers_syncing", Integer, nullable=False),  # downloading, weight or optimizer sync
    Column("step", BigInteger, nullable=False),
    Column("samples", BigInteger, nullable=False),  # the stage's deduplicated estimate
    Column("averaging_success", Double),  # mean over the workers' latest round reports
    Column("reduce_success", Double),
    PrimaryKeyConstraint("snapshot_id", "stage"),
)
Index("stage_snapshots_by_run_time", stage_snapshots.c.run, stage_snapshots.c.t)

stages = Table(
    "stages",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("stage", Integer, nullable=False),
    Column("step", BigInteger, nullable=False),  # the furthest step any worker reported
    Column("step_changed_t", Double, nullable=False),  # when that step last moved
    Column("completed_samples", BigInteger, nullable=False),  # in steps before ``step``
    Column("samples", BigInteger, nullable=False),  # completed + toward ``step``
    Column("workers_serving", Integer, nullable=False),
    Column("samples_gap", BigInteger, nullable=False),  # samples - the trainers' total
    Column("reconciled", Boolean, nullable=False),  # the gap is within the tolerance
    Column("last_t", Double, nullable=False),
    PrimaryKeyConstraint("run", "stage"),
)

worker_steps = Table(
    "worker_steps",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("stage", Integer, nullable=False),
    Column("node_id", String(NODE_ID), nullable=False),
    Column("step", BigInteger, nullable=False),
    Column("samples", BigInteger, nullable=False),
    PrimaryKeyConstraint("run", "stage", "node_id", "step"),
)

nodes = Table(
    "nodes",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("node_id", String(NODE_ID), nullable=False),
    Column("role", String(32), nullable=False),  # worker, trainer, or a member's credential role
    Column("account", String(200), nullable=False),  # its credential's ("" in an open run)
    Column("stage", Integer),
    Column("phase", String(32)),
    Column("address", String(300)),
    Column("version", String(64)),
    Column("throughput", Double),  # samples/s it announced
    Column("load", Integer),
    Column("step", BigInteger),  # a worker's last reported step
    Column("step_samples", BigInteger),  # ... and its samples toward it
    Column("samples", BigInteger, nullable=False),  # deduplicated total it processed
    Column("tokens", BigInteger, nullable=False),  # a trainer's
    Column("reported_samples", BigInteger),  # a trainer's counter as last read (resets on restart)
    Column("reported_tokens", BigInteger),
    Column("restarts", Integer, nullable=False),  # counter resets seen
    Column("loss", Double),  # a trainer's loss EMA (None while non-finite or unknown)
    Column("live", Boolean, nullable=False),  # a DHT member at the last snapshot
    Column("first_seen", Double, nullable=False),
    Column("last_seen", Double, nullable=False),
    Column("lost_t", Double),  # when it left the member list without announcing it
    Column("left_t", Double),  # when it announced leaving (a clean stop: LEFT in the DHT)
    Column("termination_reason", String(64)),  # its departure record, if it terminated itself
    Column("termination_detail", String(1100)),
    Column("terminated_t", Double),
    PrimaryKeyConstraint("run", "node_id"),
)

series_minutes = Table(
    "series_minutes",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("minute", BigInteger, nullable=False),  # floor(t / 60)
    Column("snapshots", Integer, nullable=False),
    Column("t", Double, nullable=False),  # the minute's last snapshot time
    Column("samples", BigInteger, nullable=False),  # the most (a running total: the last)
    Column("loss_sum", Double, nullable=False),  # over the snapshots with a loss ...
    Column("loss_count", Integer, nullable=False),  # ... how many: mean = sum / count
    Column("tokens_per_s_sum", Double, nullable=False),
    Column("tokens_per_s_count", Integer, nullable=False),
    Column("workers", Integer, nullable=False),  # the most
    PrimaryKeyConstraint("run", "minute"),
)

stage_series_minutes = Table(
    "stage_series_minutes",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("stage", Integer, nullable=False),
    Column("minute", BigInteger, nullable=False),
    Column("t", Double, nullable=False),
    Column("workers_serving", Integer, nullable=False),  # the fewest: a dip shows
    Column("step", BigInteger, nullable=False),  # the furthest
    Column("averaging_success_sum", Double, nullable=False),
    Column("averaging_success_count", Integer, nullable=False),
    PrimaryKeyConstraint("run", "stage", "minute"),
)

flags = Table(
    "flags",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("subject", String(NODE_ID), nullable=False),  # a node id, or "stage/N"
    Column("kind", String(32), nullable=False),
    Column("detail", String(500), nullable=False),  # the latest occurrence's
    Column("count", Integer, nullable=False),
    Column("first_t", Double, nullable=False),
    Column("last_t", Double, nullable=False),
    PrimaryKeyConstraint("run", "subject", "kind"),
)

receipts = Table(
    "receipts",
    metadata,
    Column("run", String(RUN), nullable=False),
    Column("trainer", String(NODE_ID), nullable=False),
    Column("worker", String(NODE_ID), nullable=False),
    Column("reported", BigInteger, nullable=False),  # the trainer's count as last read (resets with it)
    Column("credited", BigInteger, nullable=False),  # samples credited to the worker from it, in all
    Column("counts", Boolean, nullable=False),  # whether this trainer's receipts count for this worker
    Column("last_t", Double, nullable=False),
    PrimaryKeyConstraint("run", "trainer", "worker"),
)
