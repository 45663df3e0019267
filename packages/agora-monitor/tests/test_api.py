"""The dashboard's JSON API on its own: a real HTTP server on 127.0.0.1 over a SQLite file
holding constructed snapshots, every endpoint and every alert rule read through it."""

from __future__ import annotations

import math

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from agora_core.config import load_run_config
from agora_core.contract import DepartureReason
from agora_core.schema import WorkerDeparture
from agora_devkit.monitor import node_id, snapshot, trainer, worker
from agora_monitor.ingest import Ingest
from agora_monitor.settings import MonitorSettings
from agora_monitor.store import MonitorStore
from agora_monitor.web import make_app

T0 = 1_700_000_000.0  # 2023: the monitor_stale rule compares it with this clock
TOTAL = lambda i: 16 * (10 + i) + 6  # noqa: E731
SETTINGS = MonitorSettings(period_s=5.0, stall_after_s=60.0, min_workers=2, alert_window_s=600.0)


@pytest.fixture
def store(tmp_path, request):
    """A run of 4 stages watched for 2 minutes: stage 3 stalls at step 7, stage 0 loses w0b
    (killed, no departure), w1b terminates itself, the trainer's loss goes NaN at the end.
    The trainer's samples match stages 0-2 (two workers x 3 samples toward step 10 + i)."""
    run = load_run_config(request.config.rootpath / "examples" / "tiny.toml")
    store = MonitorStore(str(tmp_path / "monitor.db"))
    store.ensure_run(run, T0)
    ingest = Ingest(run, SETTINGS, *store.restore(run.name))
    names = [f"w{s}{r}" for s in range(4) for r in "ab"]
    for i in range(25):
        t = T0 + 5 * i
        alive = [n for n in names if not (i >= 20 and n in ("w0b", "w1b"))]
        progress = {n: (7 if n.startswith("w3") else 10 + i, 3) for n in alive}
        loss = 4.0 - 0.05 * i if i < 24 else math.nan
        snap = snapshot(t, workers=[worker(n, int(n[1])) for n in alive], progress=progress,
                        trainers=[trainer("t", TOTAL(i), loss=loss)])  # fmt: skip
        if i >= 20:
            snap.departures.append(WorkerDeparture(
                node_id=node_id("w1b"), stage=1, reason=DepartureReason.NO_PROGRESS, value=90.0, threshold=60.0,
                unit="s", step=30, time=T0 + 99, exit_code=3, detail="no step for 90 s"))  # fmt: skip
        store.write(ingest.apply(snap))
    yield store
    store.close()


@pytest.fixture
async def api(store):
    server = TestServer(make_app(store, SETTINGS), host="127.0.0.1")
    await server.start_server()
    async with aiohttp.ClientSession(base_url=str(server.make_url("/"))) as session:

        async def get(path: str, status: int = 200) -> dict:
            async with session.get(path) as response:
                assert response.status == status, await response.text()
                return await response.json()

        async def text(path: str) -> tuple[str, str]:
            async with session.get(path) as response:
                assert response.status == 200
                return response.content_type, await response.text()

        async def status(path: str) -> int:
            async with session.get(path) as response:
                return response.status

        get.text, get.status = text, status
        yield get
    await server.close()


async def test_runs_overview_series_nodes_and_leaderboard_answer_what_the_database_holds(api):
    (run,) = (await api("/api/runs"))["runs"]
    assert run["run"] == "tiny" and run["n_stages"] == 4 and run["last_t"] == T0 + 120
    overview = await api("/api/runs/tiny/overview")
    assert overview["latest"]["samples"] == TOTAL(24) and overview["latest"]["loss"] is None  # NaN -> null
    assert [s["step"] for s in overview["stages"]] == [34, 34, 34, 7]
    series = await api("/api/runs/tiny/series?points=5")
    assert 5 <= len(series["t"]) <= 6 and series["samples"][-1] == TOTAL(24)  # buckets: the last is whole
    assert series["loss"][0] == pytest.approx(4.0 - 0.05 * 2, abs=0.11)
    assert (
        set(series["stages"]) == {"0", "1", "2", "3"} and min(series["stages"]["0"]["workers_serving"]) == 1
    )
    assert len((await api("/api/runs/tiny/series"))["t"]) == 25
    nodes = {n["node_id"]: n for n in (await api("/api/runs/tiny/nodes"))["nodes"]}
    assert len(nodes) == 9
    assert nodes[node_id("w0b")]["live"] is False and nodes[node_id("w0a")]["live"] is True
    assert nodes[node_id("w1b")]["termination_reason"] == "no_progress"
    (account,) = (await api("/api/runs/tiny/leaderboard"))["accounts"]
    assert account["account"] == "acme" and (account["workers"], account["trainers"], account["live"]) == (
        8,
        1,
        7,
    )
    assert account["trainer_samples"] == TOTAL(24)


async def test_every_alert_rule_fires_on_what_it_watches(api):
    alerts = (await api("/api/runs/tiny/alerts"))["alerts"]
    fired = {(a["name"], a["subject"]) for a in alerts}
    assert ("stage_stalled", "stage 3") in fired  # no step since T0: 120 s > 60 s
    assert ("stage_few_workers", "stage 0") in fired and ("stage_few_workers", "stage 1") in fired
    assert ("stage_few_workers", "stage 2") not in fired
    assert ("worker_lost", node_id("w0b")) in fired
    assert ("worker_lost", node_id("w1b")) not in fired  # it said why it left:
    assert ("node_terminated", node_id("w1b")) in fired
    assert ("loss_nonfinite", "tiny") in fired
    assert ("samples_mismatch", "stage 3") in fired  # stalled, while the trainers went on
    assert ("samples_mismatch", "stage 0") not in fired
    assert ("monitor_stale", "tiny") in fired  # the snapshots are from 2023
    assert [a["severity"] for a in alerts] == sorted(
        (a["severity"] for a in alerts), key=["critical", "warning"].index
    )


async def test_unknown_runs_bad_parameters_and_the_page_and_assets(api, store):
    assert "no run named nope" in (await api("/api/runs/nope/nodes", status=404))["error"]
    assert "points must be a int" in (await api("/api/runs/tiny/series?points=many", status=400))["error"]
    assert "points must be >= 1" in (await api("/api/runs/tiny/series?points=0", status=400))["error"]
    flags = (await api("/api/runs/tiny/flags"))["flags"]
    assert [(f["subject"], f["kind"]) for f in flags] == [("stage/3", "samples_mismatch")]
    kind, page = await api.text("/")
    assert kind == "text/html" and '<canvas id="chart-loss-samples"' in page and "http" not in page
    kind, script = await api.text("/static/app.js")
    assert kind == "text/javascript" and "/api/runs" in script
    assert await api.status("/static/cli.py") == 404  # only the page's own assets are served
