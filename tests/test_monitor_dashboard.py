"""The health monitor on a live swarm, seen through its dashboard in a real headless Chromium.

`tools/swarm.py up` starts the smallest real swarm (examples/tiny.toml cut to two stages,
one worker each, one trainer, authorized: a seed, an authorizer, and the monitor joining
with a monitor credential), each node its own process on 127.0.0.1. The one test checks what
an operator sees: the page loads without console errors, the loss chart has points, the node
table lists every worker, the API and the database agree with it, and a killed worker
shows on the page and in the alerts within the monitor's period (plus the DHT's own
failure detection). A screenshot is kept: the test's tmp dir and runs/test-artifacts/.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from agora_core.config import load_run_config
from agora_devkit.monitor import headless_chromium
from agora_devkit.processes import wait_until
from agora_devkit.swarm import make_swarm_config, make_swarm_shards

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
SWARM = str(ROOT / "tools" / "swarm.py")
ARTIFACTS = ROOT / "runs" / "test-artifacts"
PERIOD_S = 1.0  # the monitor's snapshot period here (5 s by default)
START_S = 120  # the swarm serving and training (torch imports on a busy machine)
EDITS = {"stage_layers": "stage_layers = [1, 1]", "weight_sync_steps": "weight_sync_steps = 10"}


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _swarm_json(run_dir: Path) -> dict:
    path = run_dir / "swarm.json"
    return json.loads(path.read_text()) if path.exists() else {"members": []}


def _dashboard_url(run_dir: Path) -> str | None:
    monitor = [m for m in _swarm_json(run_dir)["members"] if m["role"] == "monitor" and m["address"]]
    return monitor[0]["address"] if monitor else None


def _workers(run_dir: Path) -> list[dict]:
    return [m for m in _swarm_json(run_dir)["members"] if m["role"] == "worker" and m["address"]]


@pytest.mark.timeout(START_S + 90, func_only=True)
def test_dashboard_shows_a_live_swarm_and_a_killed_worker(tmp_path):
    config = make_swarm_config(tmp_path, EDITS, "two.toml")
    shards, run_dir = make_swarm_shards(tmp_path / "shards", shards=3, max_mb=1), tmp_path / "run"
    run = load_run_config(config)
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen(
        [sys.executable, SWARM, "up", "--config", str(config), "--shards", str(shards), "--replicas", "1",
         "--lanes", "2", "--samples", "100000", "--duration", str(START_S), "--no-export",
         "--monitor-period", str(PERIOD_S), "--status-interval", "5", "--run-dir", str(run_dir)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until(lambda: up.poll() is None and len(_workers(run_dir)) == 2 and _dashboard_url(run_dir) is not None,
                   timeout_s=START_S, every_s=0.2, what="two workers serving and the dashboard up")  # fmt: skip
        url = _dashboard_url(run_dir)
        api = f"{url}api/runs/{run.name}"
        wait_until(
            lambda: len(_get(f"{api}/series")["loss"]) >= 2, timeout_s=60, every_s=0.5, what="loss points"
        )
        workers = {m["node_id"]: m for m in _workers(run_dir)}
        with headless_chromium() as driver:
            driver.get(url)

            def page_ready() -> bool:
                state = driver.execute_script("return window.agoraDashboard")
                listed = driver.execute_script(
                    "return [...document.querySelectorAll('#nodes tbody td:first-child')].map(td => td.title)"
                )
                return state["points"].get("chart-loss-samples", 0) >= 2 and set(workers) <= set(listed)

            wait_until(page_ready, timeout_s=30, every_s=0.2, what="loss points and every worker on the page")
            shot = tmp_path / "dashboard.png"
            driver.save_screenshot(str(shot))
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(shot, ARTIFACTS / "dashboard.png")
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert errors == [], errors
            assert driver.execute_script("return window.agoraDashboard.lastError") is None

            # the API and the database say what the page shows
            nodes = {n["node_id"]: n for n in _get(f"{api}/nodes")["nodes"]}
            for node_id, member in workers.items():
                assert nodes[node_id]["role"] == "worker" and nodes[node_id]["stage"] == member["stage"]
                assert nodes[node_id]["account"] == "swarm"  # from its credential
            with sqlite3.connect(run_dir / "monitor.db") as db:
                (snapshots,) = db.execute(
                    "SELECT count(*) FROM snapshots WHERE run = ?", (run.name,)
                ).fetchone()
            assert snapshots >= 2

            # kill the stage-1 worker: lost on the page and in the alerts within the period
            killed = subprocess.run([sys.executable, SWARM, "kill-worker", "1", "--run-dir", str(run_dir)],
                                    capture_output=True, text=True, timeout=30)  # fmt: skip
            assert killed.returncode == 0, killed.stdout + killed.stderr
            victim = next(
                m["node_id"]
                for m in _swarm_json(run_dir)["members"]
                if m["role"] == "worker" and not m["alive"]
            )
            started = time.monotonic()

            def alert_shown() -> bool:
                rows = driver.execute_script(
                    "return [...document.querySelectorAll('#alerts tbody tr')].map(tr => tr.innerText)"
                )
                return any("worker_lost" in row and victim in row for row in rows)

            # the DHT needs its suspicion timeout (and a probe) to call the worker dead
            detection_s = run.dht.suspicion_timeout_s + 2 * run.dht.gossip_period_s
            wait_until(
                alert_shown,
                timeout_s=2 * PERIOD_S + detection_s + 3,
                every_s=0.1,
                what="the worker_lost alert",
            )
            print(f"killed worker on the dashboard after {time.monotonic() - started:.1f} s")
            alerts = _get(f"{api}/alerts")["alerts"]
            assert any(a["name"] == "worker_lost" and a["subject"] == victim for a in alerts)
            assert not {n["node_id"]: n for n in _get(f"{api}/nodes")["nodes"]}[victim]["live"]
            driver.save_screenshot(str(tmp_path / "dashboard-after-kill.png"))
    finally:
        # with a stage gone the trainer's lanes cannot finish the samples they hold, which a
        # stopping trainer waits for: it is killed, then `up` stops the rest in order
        for member in _swarm_json(run_dir)["members"]:
            if member["role"] == "trainer" and member["alive"]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member["pid"], signal.SIGKILL)
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)  # `up` stops its swarm, the monitor included
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
        if (run_dir / "swarm.json").exists():
            subprocess.run(
                [sys.executable, SWARM, "down", "--run-dir", str(run_dir)], capture_output=True, timeout=60
            )
        log.close()
