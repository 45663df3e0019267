"""The monitor's database on both backends: several runs side by side, each restored whole."""

from __future__ import annotations

import dataclasses

import pytest
import sqlalchemy as sa

from agora_core.config import load_run_config
from agora_devkit.monitor import snapshot, trainer, worker
from agora_monitor import queries, schema
from agora_monitor.errors import MonitorDatabaseError
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore

T0 = 1_800_000_000.0


def test_two_runs_share_a_database_and_a_restarted_monitor_restores_each(db_url, request):
    tiny = load_run_config(request.config.rootpath / "examples" / "tiny.toml")
    other = dataclasses.replace(tiny, name="other")
    with MonitorStore(db_url) as store:
        for run, samples in ((tiny, 64), (other, 640)):
            store.ensure_run(run, T0)
            ingest = Ingest(run, MonitorSettings(), *store.restore(run.name))
            w = worker(f"{run.name}-w", 0)
            for i in range(3):  # the worker at step i with 5 samples each time
                snap = snapshot(
                    T0 + i,
                    workers=[w],
                    progress={f"{run.name}-w": (i, 5)},
                    trainers=[trainer("t", samples + i)],
                )
                store.write(ingest.apply(snap))
    with MonitorStore(db_url) as store:  # a new process: what the last one left
        with store.transaction() as connection:
            assert sorted(r["run"] for r in queries.runs(connection)) == ["other", "tiny"]
            assert queries.overview(connection, "other")["latest"]["samples"] == 642
            assert len(queries.series(connection, "tiny")["t"]) == 3
        ledger, nodes = store.restore("tiny")
        assert (
            ledger.samples == 66
            and ledger.stages[0].step == 2
            and ledger.stages[0].at_step == {2: {worker("tiny-w", 0).node_id: 5}}
        )
        assert {row["role"] for row in nodes.values()} == {"worker", "trainer"}
        assert store.restore("nothing")[0].samples == 0


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("mysql://db/x", "unsupported database"),
        ("sqlite://", "in-memory"),
        ("monitor", "not a database URL"),
        ("", "no database"),
    ],
)
def test_a_bad_database_url_is_refused_naming_the_forms_it_takes(url, why):
    with pytest.raises(MonitorDatabaseError, match=why):
        MonitorStore(url)


def test_a_database_written_before_receipts_is_upgraded_in_place_keeping_its_rows(db_url, request):
    run = load_run_config(request.config.rootpath / "examples" / "tiny.toml")
    with MonitorStore(db_url) as store:
        store.ensure_run(run, 1000.0)
        ledger, nodes = store.restore(run.name)
        store.write(
            Ingest(run, MonitorSettings(), ledger, nodes).apply(snapshot(1000.0, trainers=[trainer("t", 7)]))
        )
        engine = store._engine
        with engine.begin() as connection:  # what version 2 wrote
            schema.receipts.drop(connection)
            connection.execute(sa.update(schema.schema_info).values(version=2))
    with MonitorStore(db_url) as store:
        ledger, _ = store.restore(run.name)
        assert ledger.samples == 7 and ledger.receipts == {}
        with store.transaction() as connection:
            assert connection.scalars(sa.select(schema.schema_info.c.version)).all() == [
                schema.SCHEMA_VERSION
            ]
            assert connection.execute(sa.select(schema.receipts)).all() == []
