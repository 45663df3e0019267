"""The time series rolled up per wall-clock minute: written with each snapshot, read by long windows.

A day of 5 s snapshots is 17,280 ``snapshots`` rows and ten times as many ``stage_snapshots``;
bucketing them all on every dashboard poll cost a third of a second. Each snapshot therefore
also upserts its minute's row of ``series_minutes`` (and one per stage of
``stage_series_minutes``) in the same transaction as its raw rows, folding itself in: sums
and counts for what the series averages (loss, tokens/s, averaging success), extremes for
the rest (the last time, the most samples and steps, the most workers, the fewest serving).
A bucket of whole minutes is then exactly what bucketing the raw rows would give: a mean of
the minutes' sums over their counts is the mean of their snapshots.

:func:`rebuild` computes the same rows from the raw ones in one statement per table (for
history written without them: the benchmark's synthesised day); the tests hold the two ways
equal on both backends.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import BigInteger, case, cast, delete, func, insert, select
from sqlalchemy.engine import Connection

from agora_monitor import schema

MINUTE_S = 60


def minute_of(t: float) -> int:
    return int(t // MINUTE_S)


def _most(column, excluded):
    return case((excluded > column, excluded), else_=column)


def _fewest(column, excluded):
    return case((excluded < column, excluded), else_=column)


def write(connection: Connection, upsert: Callable, snapshot: dict, stage_snapshots: list[dict]) -> None:
    """Fold one snapshot's rows (as :class:`~.ingest.Rows` holds them) into its minute."""
    minute = minute_of(snapshot["t"])
    loss, rate = snapshot["loss"], snapshot["tokens_per_s"]
    row = {
        "run": snapshot["run"], "minute": minute, "snapshots": 1, "t": snapshot["t"],
        "samples": snapshot["samples"], "loss_sum": loss or 0.0, "loss_count": int(loss is not None),
        "tokens_per_s_sum": rate or 0.0, "tokens_per_s_count": int(rate is not None),
        "workers": snapshot["workers"],
    }  # fmt: skip
    m = schema.series_minutes.c
    statement = upsert(schema.series_minutes).values(row)
    ex = statement.excluded
    statement = statement.on_conflict_do_update(
        index_elements=["run", "minute"],
        set_={
            "snapshots": m.snapshots + ex.snapshots,
            "t": _most(m.t, ex.t),
            "samples": _most(m.samples, ex.samples),
            "loss_sum": m.loss_sum + ex.loss_sum,
            "loss_count": m.loss_count + ex.loss_count,
            "tokens_per_s_sum": m.tokens_per_s_sum + ex.tokens_per_s_sum,
            "tokens_per_s_count": m.tokens_per_s_count + ex.tokens_per_s_count,
            "workers": _most(m.workers, ex.workers),
        },
    )
    connection.execute(statement)
    if not stage_snapshots:
        return
    rows = [
        {"run": r["run"], "stage": r["stage"], "minute": minute, "t": r["t"], "workers_serving": r["workers_serving"],
         "step": r["step"], "averaging_success_sum": r["averaging_success"] or 0.0,
         "averaging_success_count": int(r["averaging_success"] is not None)}
        for r in stage_snapshots
    ]  # fmt: skip
    sm = schema.stage_series_minutes.c
    statement = upsert(schema.stage_series_minutes)
    ex = statement.excluded
    statement = statement.on_conflict_do_update(
        index_elements=["run", "stage", "minute"],
        set_={
            "t": _most(sm.t, ex.t),
            "workers_serving": _fewest(sm.workers_serving, ex.workers_serving),
            "step": _most(sm.step, ex.step),
            "averaging_success_sum": sm.averaging_success_sum + ex.averaging_success_sum,
            "averaging_success_count": sm.averaging_success_count + ex.averaging_success_count,
        },
    )
    connection.execute(statement, rows)


def _minute_expression(t, backend: str):
    # SQLite's CAST truncates (t > 0: the floor); PostgreSQL's rounds, so floor first there
    return cast(func.floor(t / MINUTE_S) if backend == "postgresql" else t / MINUTE_S, BigInteger)


def rebuild(connection: Connection, backend: str, run: str) -> None:
    """Run ``run``'s rollup rows computed afresh from its raw snapshot rows."""
    for table in (schema.series_minutes, schema.stage_series_minutes):
        connection.execute(delete(table).where(table.c.run == run))
    s = schema.snapshots.c
    minute = _minute_expression(s.t, backend)
    summary = (
        select(
            s.run,
            minute,
            func.count(),
            func.max(s.t),
            func.max(s.samples),
            func.coalesce(func.sum(s.loss), 0.0),
            func.count(s.loss),
            func.coalesce(func.sum(s.tokens_per_s), 0.0),
            func.count(s.tokens_per_s),
            func.max(s.workers),
        )
        .where(s.run == run)
        .group_by(s.run, minute)
    )
    names = [c.name for c in schema.series_minutes.columns]
    connection.execute(insert(schema.series_minutes).from_select(names, summary))
    ss = schema.stage_snapshots.c
    minute = _minute_expression(ss.t, backend)
    summary = (
        select(
            ss.run,
            ss.stage,
            minute,
            func.max(ss.t),
            func.min(ss.workers_serving),
            func.max(ss.step),
            func.coalesce(func.sum(ss.averaging_success), 0.0),
            func.count(ss.averaging_success),
        )
        .where(ss.run == run)
        .group_by(ss.run, ss.stage, minute)
    )
    names = [c.name for c in schema.stage_series_minutes.columns]
    connection.execute(insert(schema.stage_series_minutes).from_select(names, summary))


def _mean(total, count) -> float | None:
    return None if not count else float(total) / count


def read(connection: Connection, run: str, first: float, width_s: float, out: dict) -> None:
    """The series from ``first`` in buckets of whole minutes, at least ``width_s`` wide, into
    ``out`` (the shape :func:`~.queries.series` answers). The first bucket starts at the minute
    holding ``first``: it may hold up to a minute of snapshots before it."""
    minutes = max(1, -(-int(width_s) // MINUTE_S))  # the bucket's width in minutes, rounded up
    start = minute_of(first)
    m = schema.series_minutes.c
    bucket = ((m.minute - start) // minutes).label("bucket")
    query = (
        select(
            bucket,
            func.max(m.t),
            func.max(m.samples),
            func.sum(m.loss_sum),
            func.sum(m.loss_count),
            func.sum(m.tokens_per_s_sum),
            func.sum(m.tokens_per_s_count),
            func.max(m.workers),
        )
        .where(m.run == run, m.minute >= start)
        .group_by(bucket)
        .order_by(bucket)
    )
    for _, t, samples, loss, losses, rate, rates, workers in connection.execute(query):
        out["t"].append(t)
        out["samples"].append(int(samples))
        out["loss"].append(_mean(loss, losses))
        out["tokens_per_s"].append(_mean(rate, rates))
        out["workers"].append(workers)
    sm = schema.stage_series_minutes.c
    bucket = ((sm.minute - start) // minutes).label("bucket")
    query = (
        select(
            sm.stage,
            bucket,
            func.max(sm.t),
            func.min(sm.workers_serving),
            func.max(sm.step),
            func.sum(sm.averaging_success_sum),
            func.sum(sm.averaging_success_count),
        )
        .where(sm.run == run, sm.minute >= start)
        .group_by(sm.stage, bucket)
        .order_by(sm.stage, bucket)
    )
    for stage, _, t, serving, step, averaging, count in connection.execute(query):
        entry = out["stages"].setdefault(
            str(stage), {"t": [], "workers_serving": [], "step": [], "averaging_success": []}
        )
        entry["t"].append(t)
        entry["workers_serving"].append(serving)
        entry["step"].append(int(step))
        entry["averaging_success"].append(_mean(averaging, count))
