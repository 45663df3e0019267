"""The per-minute rollup on both backends: what each snapshot folds in equals what a rebuild
from the raw rows computes, and a long window's series read from it is the exact mean and
extremes of the snapshots in each bucket of whole minutes."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from agora_core.config import load_run_config
from agora_devkit.monitor import snapshot, trainer, worker
from agora_monitor import queries, schema
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore

T0 = 1_800_000_000.0  # a whole minute: the buckets below start at T0
STEP_S = 20.0
SNAPSHOTS = 30  # ten minutes, three snapshots a minute


def _loss(i: int) -> float:
    return 4.0 - 0.01 * i * i


def _rollup_rows(store: MonitorStore) -> list[list[dict]]:
    with store.transaction() as connection:
        return [
            [dict(row) for row in connection.execute(select(table).order_by(*table.primary_key)).mappings()]
            for table in (schema.series_minutes, schema.stage_series_minutes)
        ]


def test_the_rollup_each_snapshot_writes_equals_a_rebuild_and_buckets_long_windows_exactly(db_url, request):
    run = load_run_config(request.config.rootpath / "examples" / "tiny.toml")
    names = [f"w{s}{r}" for s in range(run.model.n_stages) for r in "ab"]
    with MonitorStore(db_url) as store:
        store.ensure_run(run, T0)
        ingest = Ingest(run, MonitorSettings(), *store.restore(run.name))
        for i in range(SNAPSHOTS):
            alive = [n for n in names if not (n == "w0b" and i % 7 == 3)]  # stage 0 dips now and then
            snap = snapshot(T0 + STEP_S * i, workers=[worker(n, int(n[1])) for n in alive],
                            progress={n: (i, 2) for n in alive}, trainers=[trainer("t", 10 * i, loss=_loss(i))])  # fmt: skip
            store.write(ingest.apply(snap))
        written = _rollup_rows(store)
        store.rebuild_rollup(run.name)
        rebuilt = _rollup_rows(store)
        assert [len(rows) for rows in written] == [10, 10 * run.model.n_stages]
        for ours, theirs in zip(written, rebuilt, strict=True):
            assert ours == [pytest.approx(row) for row in theirs]
        with store.transaction() as connection:
            long = queries.series(connection, run.name, points=5, raw_window_s=0.0)
            raw = queries.series(connection, run.name, points=5)
    # 580 s in 5 points: buckets of 2 whole minutes, 6 snapshots each
    assert len(long["t"]) == 5 and len(raw["t"]) in (5, 6)
    for b in range(5):
        held = range(6 * b, 6 * b + 6)
        assert long["t"][b] == T0 + STEP_S * held[-1]
        assert long["samples"][b] == 10 * held[-1]
        assert long["loss"][b] == pytest.approx(sum(_loss(i) for i in held) / 6)
        assert long["stages"]["0"]["workers_serving"][b] == (1 if any(i % 7 == 3 for i in held) else 2)
        assert long["stages"]["1"]["workers_serving"][b] == 2 and long["stages"]["1"]["step"][b] == held[-1]
    assert long["tokens_per_s"][0] == pytest.approx(10 * run.model.seq_len / STEP_S)  # the first has none
