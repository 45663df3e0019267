"""What the dashboard's JSON API reads: each function one answer, from one read transaction.

Time series are bucketed in the database (``points`` buckets over the asked window, each the
mean or the last of its snapshots), so an answer's size does not grow with the run's length;
a window longer than :data:`RAW_WINDOW_S` is bucketed from the per-minute rollup
(:mod:`.rollup`), so neither does the work of answering it.
"""

from __future__ import annotations

import math

from sqlalchemy import Double, Integer, Table, cast, func, select
from sqlalchemy.engine import Connection

from agora_monitor import rollup, schema

MAX_POINTS = 2000  # the most buckets a series answer holds
# windows up to this long are bucketed from the raw snapshots (at a 5 s period, 720 of them
# and a row per stage each: a few ms), longer ones from the rollup in whole minutes
RAW_WINDOW_S = 3600.0


def _finite(value):
    """JSON has no NaN or infinity: a non-finite number reads as null."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _row(mapping) -> dict:
    return {key: _finite(value) for key, value in mapping.items()}


def _rows(result, table: Table) -> list[dict]:
    """Every row of ``result`` (whole rows of ``table``) as a dict, non-finite floats as None.
    Only the table's float columns are checked: a thousand nodes' 27 values each, one call
    apiece, were most of the ``nodes`` answer's time."""
    keys = list(result.keys())
    floats = [c.name for c in table.columns if isinstance(c.type, Double)]
    rows = [dict(zip(keys, row, strict=True)) for row in result]
    for row in rows:
        for key in floats:
            value = row[key]
            if value is not None and not math.isfinite(value):
                row[key] = None
    return rows


def runs(connection: Connection) -> list[dict]:
    r = schema.runs
    rows = connection.execute(select(r).order_by(r.c.last_t.desc())).mappings()
    return [_row(row) for row in rows]


def run_row(connection: Connection, run: str) -> dict | None:
    row = connection.execute(select(schema.runs).where(schema.runs.c.run == run)).mappings().first()
    return None if row is None else _row(row)


def overview(connection: Connection, run: str) -> dict:
    """The latest snapshot's figures and every stage's current state."""
    s = schema.snapshots
    latest = (
        connection.execute(select(s).where(s.c.run == run).order_by(s.c.t.desc()).limit(1)).mappings().first()
    )
    st = schema.stages
    stages = connection.execute(select(st).where(st.c.run == run).order_by(st.c.stage)).mappings()
    return {
        "latest": None if latest is None else _row(latest),
        "stages": [_row(row) for row in stages],
    }


def _window(connection: Connection, run: str, since: float | None) -> tuple[float, float] | None:
    s = schema.snapshots
    query = select(func.min(s.c.t), func.max(s.c.t)).where(s.c.run == run)
    if since is not None:
        query = query.where(s.c.t >= since)
    first, last = connection.execute(query).one()
    return None if first is None else (first, last)


def series(
    connection: Connection,
    run: str,
    *,
    points: int = 300,
    since: float | None = None,
    raw_window_s: float = RAW_WINDOW_S,
) -> dict:
    """The run's time series (loss, samples, tokens/s, workers) and each stage's (serving
    workers, step, averaging success), in at most ``points`` buckets from ``since``; windows
    longer than ``raw_window_s`` in buckets of whole minutes (fewer, if ``points`` asks for
    finer)."""
    points = max(1, min(points, MAX_POINTS))
    out: dict = {"t": [], "samples": [], "loss": [], "tokens_per_s": [], "workers": [], "stages": {}}
    window = _window(connection, run, since)
    if window is None:
        return out
    first, last = window
    width = max((last - first) / points, 1e-3)
    if last - first > raw_window_s:
        rollup.read(connection, run, first, width, out)
        for name in ("loss", "tokens_per_s"):
            out[name] = [_finite(value) for value in out[name]]
        for entry in out["stages"].values():
            entry["averaging_success"] = [_finite(value) for value in entry["averaging_success"]]
        return out
    s = schema.snapshots
    bucket = cast((s.c.t - first) / width, Integer).label("bucket")
    query = (
        select(
            bucket,
            func.max(s.c.t),
            func.max(s.c.samples),
            func.avg(s.c.loss),
            func.avg(s.c.tokens_per_s),
            func.max(s.c.workers),
        )
        .where(s.c.run == run, s.c.t >= first)
        .group_by(bucket)
        .order_by(bucket)
    )
    for _, t, samples, loss, rate, workers in connection.execute(query):
        for name, value in (
            ("t", t),
            ("samples", samples),
            ("loss", loss),
            ("tokens_per_s", rate),
            ("workers", workers),
        ):
            out[name].append(
                _finite(None if value is None else float(value) if name != "samples" else int(value))
            )
    ss = schema.stage_snapshots
    bucket = cast((ss.c.t - first) / width, Integer).label("bucket")
    query = (
        select(
            ss.c.stage,
            bucket,
            func.max(ss.c.t),
            func.min(ss.c.workers_serving),  # the dip is what matters: a lost worker shows
            func.max(ss.c.step),
            func.avg(ss.c.averaging_success),
        )
        .where(ss.c.run == run, ss.c.t >= first)
        .group_by(ss.c.stage, bucket)
        .order_by(ss.c.stage, bucket)
    )
    for stage, _, t, serving, step, averaging in connection.execute(query):
        entry = out["stages"].setdefault(
            str(stage), {"t": [], "workers_serving": [], "step": [], "averaging_success": []}
        )
        entry["t"].append(t)
        entry["workers_serving"].append(serving)
        entry["step"].append(step)
        entry["averaging_success"].append(_finite(None if averaging is None else float(averaging)))
    return out


def nodes(connection: Connection, run: str) -> list[dict]:
    n = schema.nodes
    query = select(n).where(n.c.run == run).order_by(n.c.role, n.c.stage, n.c.node_id)
    return _rows(connection.execute(query), n)


def leaderboard(connection: Connection, run: str) -> list[dict]:
    """Per credential account: its nodes, live ones, and the samples they processed: its
    workers' by the receipts that count for them (trainers' signed counts, :mod:`.ledger`),
    next to what they reported themselves; its trainers' completed ones."""
    n, r = schema.nodes, schema.receipts
    worker = n.c.role == "worker"
    trainer = n.c.role == "trainer"
    query = (
        select(
            n.c.account,
            func.count().label("nodes"),
            func.sum(cast(n.c.live, Integer)).label("live"),
            func.sum(cast(worker, Integer)).label("workers"),
            func.sum(cast(trainer, Integer)).label("trainers"),
            func.coalesce(func.sum(n.c.samples).filter(worker), 0).label("reported_worker_samples"),
            func.coalesce(func.sum(n.c.samples).filter(trainer), 0).label("trainer_samples"),
        )
        .where(n.c.run == run)
        .group_by(n.c.account)
    )
    receipted = (
        select(n.c.account, func.sum(r.c.credited).label("credited"))
        .select_from(r)
        .join(n, (n.c.run == r.c.run) & (n.c.node_id == r.c.worker))
        .where(r.c.run == run)
        .group_by(n.c.account)
    )
    credited = {account: int(total or 0) for account, total in connection.execute(receipted)}
    rows = [
        {k: (int(v) if k != "account" and v is not None else v) for k, v in row.items()}
        for row in connection.execute(query).mappings()
    ]
    for row in rows:
        row["worker_samples"] = credited.get(row["account"], 0)
    rows.sort(key=lambda row: (-(row["worker_samples"] + row["trainer_samples"]), row["account"]))
    return rows


def flags(connection: Connection, run: str, *, since: float | None = None) -> list[dict]:
    f = schema.flags
    query = select(f).where(f.c.run == run)
    if since is not None:
        query = query.where(f.c.last_t >= since)
    return [_row(row) for row in connection.execute(query.order_by(f.c.last_t.desc())).mappings()]
