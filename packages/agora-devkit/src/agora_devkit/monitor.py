"""Helpers for the monitor's tests and benchmark: constructed snapshots, a headless browser.

Nothing here runs in a monitor. :func:`worker`, :func:`trainer` and :func:`snapshot` build
the records a run publishes (as the DHT would hand them to :func:`~.snapshot.read_snapshot`'s
caller) so the ledger's rules are tested on exact numbers; :func:`headless_chromium` drives
the system's Chromium (Debian's ``chromium`` and ``chromium-driver``; ``tools/dev.py test``
installs them) through Selenium, with the page's console log kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from collections.abc import Iterator

from agora_core.contract import Phase
from agora_core.schema import StageProgress, TrainerProgress, WorkerAnnouncement
from agora_monitor.snapshot import MemberInfo, Snapshot

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
BROWSER_HINT = "install Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)"


def node_id(name: str) -> str:
    """A node id (40 hex digits) for a test's named node."""
    return hashlib.sha256(name.encode()).hexdigest()[:40]


def worker(
    name: str, stage: int, *, throughput: float = 50.0, phase: Phase = Phase.SERVING
) -> WorkerAnnouncement:
    return WorkerAnnouncement(
        node_id=node_id(name), address=f"tcp://127.0.0.1:{1000 + stage}", stage=stage, phase=phase,
        throughput=throughput, load=0, max_batch=8, version="0.1.0",
    )  # fmt: skip


def trainer(
    name: str,
    samples: int,
    *,
    loss: float | None = 3.0,
    seq_len: int = 128,
    lanes: int = 4,
    receipts: dict[str, int] | None = None,
) -> TrainerProgress:
    """A trainer's report; ``receipts``: worker name -> the samples it vouches for."""
    return TrainerProgress(
        node_id=node_id(name),
        loss_ema=loss,
        loss_last=loss,
        samples=samples,
        tokens=samples * seq_len,
        lanes=lanes,
        receipts={node_id(worker): count for worker, count in (receipts or {}).items()},
    )


def snapshot(
    t: float,
    *,
    workers: list[WorkerAnnouncement] = (),
    progress: dict[str, tuple[int, int]] | None = None,
    trainers: list[TrainerProgress] = (),
    account: str = "acme",
    accounts: dict[str, str] | None = None,
) -> Snapshot:
    """A snapshot at ``t`` of live ``workers`` (their progress: name -> (step, samples)) and
    ``trainers``, every node a member under ``account`` but those ``accounts`` names (node
    name -> its account)."""
    snap = Snapshot(t=t, workers=list(workers), trainers=list(trainers))
    by_id = {w.node_id: w for w in workers}
    for name, (step, samples) in (progress or {}).items():
        announced = by_id[node_id(name)]
        report = StageProgress(node_id=announced.node_id, step=step, samples=samples)
        snap.progress.setdefault(announced.stage, []).append(report)
    held = {node_id(name): owner for name, owner in (accounts or {}).items()}
    for w in workers:
        snap.members[w.node_id] = MemberInfo(
            w.node_id, w.address, "worker", held.get(w.node_id, account), w.stage
        )
    for tr in trainers:
        snap.members[tr.node_id] = MemberInfo(tr.node_id, "", "trainer", held.get(tr.node_id, account), None)
    return snap


@contextlib.contextmanager
def headless_chromium(*, width: int = 1400, height: int = 2200) -> Iterator:
    """A Selenium driver on the system's headless Chromium, its browser console logged (read
    it with ``driver.get_log("browser")``); always quit. RuntimeError naming what to
    install when Chromium or its driver is missing."""
    if shutil.which(CHROMIUM) is None or shutil.which(CHROMEDRIVER) is None:
        raise RuntimeError(f"no {CHROMIUM} or {CHROMEDRIVER}: {BROWSER_HINT}")
    from selenium import webdriver  # a dev requirement: only the browser tests import it
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):  # fmt: skip
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
