"""The snapshot loop: read the run from the DHT, fold it into the ledger, write it down.

:class:`Monitor` owns the run's :class:`~.ingest.Ingest` (ledger and node rows) and is the
only writer of the database; its writes run on one thread of their own, so the event loop
(the DHT member's sockets, the dashboard's requests) never waits on a commit. A snapshot
that fails (the DHT does not answer, the database is down) is logged and counted and the
next one tried a period later: the monitor outlives the faults it reports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import Counter

from agora_core import world
from agora_core.config import RunConfig
from agora_core.dht import DhtError, DhtNode
from agora_core.errors import AgoraError
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_monitor.alerts import ALERT_NAMES, current_alerts
from agora_monitor.ingest import Ingest, Rows
from agora_monitor.settings import MonitorSettings
from agora_monitor.snapshot import read_snapshot
from agora_monitor.store import MonitorStore

log = get_logger("monitor")


class Monitor:
    def __init__(
        self,
        *,
        run: RunConfig,
        store: MonitorStore,
        dht: DhtNode,
        settings: MonitorSettings,
        metrics: NodeMetrics,
    ):
        self.run = run
        self.store = store
        self.dht = dht
        self.settings = settings
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="monitor-db")
        self._ingest: Ingest | None = None
        self.snapshots = 0  # written since this process started
        self.last_error: str | None = None
        self._m_snapshots = metrics.counter(
            "agora_monitor_snapshots_total",
            "Snapshots read and written, by outcome (ok, failed).",
            ("outcome",),
        )
        self._m_seconds = metrics.histogram(
            "agora_monitor_snapshot_seconds", "Reading one snapshot from the DHT and writing it.",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10),
        )  # fmt: skip
        self._m_last_seconds = metrics.gauge(
            "agora_monitor_last_snapshot_seconds", "The last snapshot's read, fold and commit, in seconds."
        )
        self._m_last_time = metrics.gauge(
            "agora_monitor_last_snapshot_timestamp_seconds", "Wall-clock time of the last snapshot written."
        )
        self._m_flags = metrics.counter(
            "agora_monitor_flags_total", "Records distrusted, by kind.", ("kind",)
        )
        self._m_alerts = metrics.gauge(
            "agora_monitor_alerts_firing", "Alerts firing after the last snapshot, by name.", ("name",)
        )
        for name in ALERT_NAMES:  # every series from the start: a rule that never fired reads 0
            self._m_alerts.labels(name=name).set(0)
        for outcome in ("ok", "failed"):
            self._m_snapshots.labels(outcome=outcome)

    async def _in_writer(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def restore(self) -> None:
        """Continue the run's totals from the database (a fresh ledger for a new run)."""
        await self._in_writer(self.store.ensure_run, self.run, world.wall())
        ledger, nodes = await self._in_writer(self.store.restore, self.run.name)
        self._ingest = Ingest(self.run, self.settings, ledger, nodes)
        log.info("monitor_restored", run=self.run.name, nodes=len(nodes), samples=ledger.samples)

    def _write(self, rows: Rows) -> list[dict]:
        """On the writer thread: commit ``rows``, then judge the alerts on what it left."""
        self.store.write(rows)
        with self.store.transaction() as connection:
            return current_alerts(connection, self.run.name, self.settings)

    async def snapshot_once(self) -> Rows:
        """One snapshot, read, folded and committed, counted by outcome; DhtError or the
        store's error if it fails."""
        try:
            if self._ingest is None:
                await self.restore()
            started = time.perf_counter()
            snapshot = await read_snapshot(self.dht, self.run)
            rows = self._ingest.apply(snapshot)
            rows.snapshot["ingest_s"] = time.perf_counter() - started  # the write is not in it
            alerts = await self._in_writer(self._write, rows)
        except Exception:  # not a cancellation: a monitor stopped mid-snapshot did not fail
            self._m_snapshots.labels(outcome="failed").inc()
            raise
        seconds = time.perf_counter() - started
        self.snapshots += 1
        self._m_snapshots.labels(outcome="ok").inc()
        self._m_seconds.observe(seconds)
        self._m_last_seconds.set(seconds)
        self._m_last_time.set(rows.snapshot["t"])
        for flag in rows.flags:
            self._m_flags.labels(kind=flag.kind).inc()
        firing = Counter(alert["name"] for alert in alerts)
        for name in ALERT_NAMES:
            self._m_alerts.labels(name=name).set(firing[name])
        return rows

    async def run_forever(self) -> None:
        """A snapshot every ``period_s``, until cancelled."""
        while True:
            started = world.monotonic()
            try:
                rows = await self.snapshot_once()
            except (DhtError, AgoraError, TimeoutError) as exc:
                self.last_error = str(exc)
                log.warning("monitor_snapshot_failed", error=str(exc))
            else:
                self.last_error = None
                log.debug(
                    "monitor_snapshot", workers=rows.snapshot["workers"], samples=rows.snapshot["samples"]
                )
            await asyncio.sleep(max(0.0, self.settings.period_s - (world.monotonic() - started)))

    def close(self) -> None:
        self._writer.shutdown(wait=True)
