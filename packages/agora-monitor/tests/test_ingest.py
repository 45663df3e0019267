"""Counting each sample once, reconciling stages with trainers, and distrusting bad claims:
constructed snapshots folded into a real SQLite file, read back from it."""

from __future__ import annotations

import dataclasses

import pytest

from agora_core.config import load_run_config
from agora_devkit.monitor import node_id, snapshot, trainer, worker
from agora_monitor import queries
from agora_monitor.alerts import current_alerts
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore

T0 = 1_800_000_000.0
TARGET = 16  # examples/tiny.toml's target_batch_size


@pytest.fixture
def run(request):
    return load_run_config(request.config.rootpath / "examples" / "tiny.toml")


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "monitor.db")


def monitor(db: str, run, settings: MonitorSettings | None = None) -> tuple[MonitorStore, Ingest]:
    """A store on ``db`` and the run's ingest as a (re)started monitor restores it."""
    store = MonitorStore(db)
    store.ensure_run(run, T0)
    ledger, nodes = store.restore(run.name)
    return store, Ingest(run, settings or MonitorSettings(), ledger, nodes)


def fold(store: MonitorStore, ingest: Ingest, snap) -> list:
    rows = ingest.apply(snap)
    store.write(rows)
    return rows.flags


def node(store: MonitorStore, run, name: str) -> dict:
    with store.transaction() as connection:
        return {n["node_id"]: n for n in queries.nodes(connection, run.name)}[node_id(name)]


def stage_row(store: MonitorStore, run, stage: int) -> dict:
    with store.transaction() as connection:
        return queries.overview(connection, run.name)["stages"][stage]


def test_replicas_repeated_snapshots_and_a_restarted_worker_count_each_sample_once(db, run):
    store, ingest = monitor(db, run)
    a, b = worker("a", 0), worker("b", 0)
    # two replicas of stage 0 at step 3: 5 + 6 samples; the same reports read twice
    fold(store, ingest, snapshot(T0, workers=[a, b], progress={"a": (3, 5), "b": (3, 6)}))
    fold(store, ingest, snapshot(T0 + 1, workers=[a, b], progress={"a": (3, 5), "b": (3, 6)}))
    assert node(store, run, "a")["samples"] == 5 and node(store, run, "b")["samples"] == 6
    # first sight at step 3: steps 0..2 were done, each at least a batch; plus what step 3 holds
    assert stage_row(store, run, 0)["samples"] == 3 * TARGET + 11
    # a grows to 9 at step 3; then the stage steps (b saw 10 at step 3 before it stepped)
    fold(store, ingest, snapshot(T0 + 2, workers=[a, b], progress={"a": (3, 9), "b": (3, 10)}))
    fold(store, ingest, snapshot(T0 + 3, workers=[a, b], progress={"a": (4, 2), "b": (4, 1)}))
    assert node(store, run, "a")["samples"] == 9 + 2 and node(store, run, "b")["samples"] == 10 + 1
    assert stage_row(store, run, 0)["samples"] == 3 * TARGET + 19 + 3  # step 3 held 19 > 16
    # a restarts from an older checkpoint (step 2): its reports there add nothing ...
    fold(store, ingest, snapshot(T0 + 4, workers=[a, b], progress={"a": (2, 7), "b": (4, 1)}))
    assert node(store, run, "a")["samples"] == 11
    # ... until it grows past what it reported there
    fold(store, ingest, snapshot(T0 + 5, workers=[a, b], progress={"a": (2, 8), "b": (4, 1)}))
    assert node(store, run, "a")["samples"] == 12
    store.close()


def test_a_trainer_restart_adds_its_new_counter_and_a_monitor_restart_continues_the_totals(db, run):
    store, ingest = monitor(db, run)
    fold(store, ingest, snapshot(T0, trainers=[trainer("t", 100)]))
    fold(store, ingest, snapshot(T0 + 5, trainers=[trainer("t", 130)]))
    fold(store, ingest, snapshot(T0 + 10, trainers=[trainer("t", 130)]))  # read again: nothing new
    fold(store, ingest, snapshot(T0 + 15, trainers=[trainer("t", 20)]))  # the trainer restarted
    store.close()
    # a new monitor process on the same file: the same totals, and it goes on from them
    store, ingest = monitor(db, run)
    assert ingest.ledger.samples == 150
    fold(store, ingest, snapshot(T0 + 20, trainers=[trainer("t", 50)]))
    row = node(store, run, "t")
    assert (row["samples"], row["tokens"], row["restarts"]) == (180, 180 * 128, 1)
    with store.transaction() as connection:
        assert queries.series(connection, run.name)["samples"] == [100, 130, 130, 150, 180]
    store.close()


def test_a_worker_faster_than_its_announced_throughput_is_flagged_in_one_counted_row(db, run):
    store, ingest = monitor(db, run, MonitorSettings(rate_slack=2.0))
    slow = worker("slow", 1, throughput=10.0)  # at most 2 x 10 samples/s + one batch (8)
    fold(store, ingest, snapshot(T0, workers=[slow], progress={"slow": (1, 0)}))
    flags = fold(store, ingest, snapshot(T0 + 2, workers=[slow], progress={"slow": (1, 48)}))  # 40 + 8
    assert [f for f in flags if f.kind == "impossible_rate"] == []
    flags = fold(store, ingest, snapshot(T0 + 4, workers=[slow], progress={"slow": (1, 97)}))
    assert [(f.subject, f.kind) for f in flags if f.kind == "impossible_rate"] == [
        (node_id("slow"), "impossible_rate")
    ]
    fold(store, ingest, snapshot(T0 + 6, workers=[slow], progress={"slow": (1, 200)}))
    with store.transaction() as connection:
        (flag,) = [f for f in queries.flags(connection, run.name) if f["subject"] == node_id("slow")]
    assert (flag["kind"], flag["count"]) == ("impossible_rate", 2)  # one row, counted
    store.close()


def test_stage_samples_far_from_the_trainers_are_flagged_as_a_mismatch(db, run):
    settings = MonitorSettings(reconcile_tolerance=0.1, reconcile_batches=1)
    store, ingest = monitor(db, run, settings)
    w = [worker(f"w{s}", s) for s in range(run.model.n_stages)]
    at = {f"w{s}": (10, 4) for s in range(run.model.n_stages)}
    # every stage at step 10: 10 * 16 + 4 = 164 samples; the trainers say 160: agreed
    flags = fold(store, ingest, snapshot(T0, workers=w, progress=at, trainers=[trainer("t", 160)]))
    assert [f for f in flags if f.kind == "samples_mismatch"] == []
    # stage 2 claims 20 more steps than the others, inside one snapshot period
    at["w2"] = (30, 0)
    flags = fold(store, ingest, snapshot(T0 + 5, workers=w, progress=at, trainers=[trainer("t", 170)]))
    assert [(f.subject, f.kind) for f in flags if f.kind == "samples_mismatch"] == [
        ("stage/2", "samples_mismatch")
    ]
    assert stage_row(store, run, 2)["reconciled"] is False and stage_row(store, run, 1)["reconciled"] is True
    store.close()


def test_a_worker_that_left_cleanly_shows_as_left_and_only_a_vanished_one_as_lost(db, run):
    store, ingest = monitor(db, run)
    names = ("stays", "leaves", "vanishes", "late")
    for i in range(4):
        alive = [n for n in names if i < 2 or n == "stays"]
        snap = snapshot(
            T0 + 5 * i, workers=[worker(n, 0) for n in alive], progress={n: (i, 1) for n in alive}
        )
        if i >= 2:
            snap.left = {node_id("leaves")}
        if i >= 3:  # its LEFT reached this member after its probes had failed
            snap.left.add(node_id("late"))
        fold(store, ingest, snap)
    left, vanished, late = (node(store, run, n) for n in ("leaves", "vanishes", "late"))
    assert (left["live"], left["left_t"], left["lost_t"]) == (False, T0 + 10, None)
    assert (vanished["live"], vanished["left_t"], vanished["lost_t"]) == (False, None, T0 + 10)
    assert (late["left_t"], late["lost_t"]) == (T0 + 15, None)
    with store.transaction() as connection:
        alerts = current_alerts(connection, run.name, MonitorSettings(), now=T0 + 15)
    assert [a["subject"] for a in alerts if a["name"] == "worker_lost"] == [node_id("vanishes")]
    store.close()


def leaderboard(store: MonitorStore, run) -> dict[str, dict]:
    with store.transaction() as connection:
        return {row["account"]: row for row in queries.leaderboard(connection, run.name)}


def test_workers_are_credited_by_trainers_receipts_not_by_what_they_report(db, run):
    store, ingest = monitor(db, run)
    a, b = worker("a", 0), worker("b", 0)
    apart = {"a": "alice", "b": "bob", "t": "tom"}  # the trainer is of neither worker's account
    # a claims 1000 samples in its own progress; the trainer vouches for 30 of a's and 10 of b's
    snap = snapshot(
        T0, workers=[a, b], progress={"a": (0, 1000), "b": (0, 10)}, accounts=apart,
        trainers=[trainer("t", 40, receipts={"a": 30, "b": 10})],
    )  # fmt: skip
    fold(store, ingest, snap)
    board = leaderboard(store, run)
    assert board["alice"]["worker_samples"] == 30 and board["alice"]["reported_worker_samples"] == 1000
    assert board["bob"]["worker_samples"] == 10 and board["tom"]["trainer_samples"] == 40

    # read again: nothing new; then 5 more for a; then the trainer restarts (its counts drop)
    def reported(t: float, samples: int, receipts: dict[str, int]) -> None:
        fold(
            store,
            ingest,
            snapshot(t, workers=[a, b], accounts=apart, trainers=[trainer("t", samples, receipts=receipts)]),
        )

    for t in (T0 + 1, T0 + 2):
        reported(t, 45, {"a": 35, "b": 10})
    reported(T0 + 3, 4, {"a": 4})
    assert leaderboard(store, run)["alice"]["worker_samples"] == 35 + 4
    store.close()
    # a restarted monitor continues the same counts: the trainer's next report adds only what is new
    store, ingest = monitor(db, run)
    reported(T0 + 4, 9, {"a": 9})
    assert leaderboard(store, run)["alice"]["worker_samples"] == 35 + 9
    store.close()


def test_receipts_beyond_one_per_stage_for_each_new_sample_are_flagged_and_credit_nothing(db, run):
    store, ingest = monitor(db, run)
    a, b = worker("a", 0), worker("b", 1)
    apart = {"a": "alice", "b": "bob", "t": "tom"}
    fold(
        store,
        ingest,
        snapshot(
            T0, workers=[a, b], accounts=apart, trainers=[trainer("t", 10, receipts={"a": 10, "b": 10})]
        ),
    )
    # 10 new samples through 4 stages: at most 40 receipts; it claims 30 + 25
    inflated = [trainer("t", 20, receipts={"a": 10 + 30, "b": 10 + 25})]
    flags = fold(store, ingest, snapshot(T0 + 1, workers=[a, b], accounts=apart, trainers=inflated))
    assert [f.kind for f in flags] == ["receipts_exceed"] and "at most 40" in flags[0].detail
    board = leaderboard(store, run)
    assert board["alice"]["worker_samples"] == 10 and board["bob"]["worker_samples"] == 10
    # the next report adds only what is new after the inflated one
    fold(
        store,
        ingest,
        snapshot(
            T0 + 2, workers=[a, b], accounts=apart, trainers=[trainer("t", 22, receipts={"a": 42, "b": 35})]
        ),
    )
    assert leaderboard(store, run)["alice"]["worker_samples"] == 12
    store.close()


def test_a_trainer_vouches_for_its_own_accounts_workers_only_as_the_operators_or_in_an_open_run(db, run):
    anchored = dataclasses.replace(run, admission=dataclasses.replace(run.admission, anchor_accounts=["ops"]))
    self_dealing = [trainer("t", 50, receipts={"a": 50})]  # one contributor runs the trainer and the worker
    cases = [("mallory", run, 0), ("ops", anchored, 50), ("", run, 50)]  # "": an open run, no credentials
    for index, (account, config, credited) in enumerate(cases):
        store, ingest = monitor(db.replace(".db", f"-{index}.db"), config)
        fold(store, ingest, snapshot(T0, workers=[worker("a", 0)], trainers=self_dealing, account=account))
        assert leaderboard(store, config)[account]["worker_samples"] == credited, account
        store.close()
