"""Reading a run from a real DHT (three in-process members on 127.0.0.1): what its nodes
publish arrives in the snapshot, and a record written for another node is flagged, not counted;
the monitor's own metrics say so on a real /metrics endpoint."""

from __future__ import annotations

import contextlib
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agora_core.config import NodeSettings, load_run_config
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_core.observability.metrics_exposure import MetricsExposure
from agora_core.schema import StageProgress, stage_progress_key, stage_workers_key, trainer_progress_key
from agora_devkit.monitor import trainer, worker
from agora_devkit.processes import wait_until_async
from agora_monitor.errors import MonitorDatabaseError
from agora_monitor.ingest import Ingest
from agora_monitor.ledger import Ledger
from agora_monitor.service import Monitor
from agora_monitor.settings import MonitorSettings
from agora_monitor.snapshot import read_snapshot
from agora_monitor.store import MonitorStore


@pytest.fixture
def run(request):
    return load_run_config(request.config.rootpath / "examples" / "tiny.toml")  # an open run


@contextlib.asynccontextmanager
async def members(run, count: int):
    nodes: list[RunNode] = []
    try:
        for _ in range(count):
            bootstrap = [nodes[0].dht.address] if nodes else []
            node = RunNode(
                run=run, key=NodeKey.generate(), metrics=NodeMetrics(role="test"), bootstrap=bootstrap
            )
            nodes.append(node)
            await node.start()
        await wait_until_async(
            lambda: all(len(n.dht.members()) == count for n in nodes), timeout_s=10, what="membership"
        )
        yield nodes
    finally:
        for node in reversed(nodes):
            await node.stop()


async def publish(node: RunNode, key: str, value: dict) -> None:
    await OwnedEntry(node.dht, node.key, key).publish(value, ttl_s=30.0)


async def publish_honest_and_forged(run, honest: RunNode, liar: RunNode) -> StageProgress:
    """An honest stage-1 worker's announcement and report (returned), the liar's forged
    report for it, and the liar's own trainer progress (40 samples)."""
    mine = worker("x", 1)
    honest_worker = type(mine)(**{**mine.to_value(), "node_id": honest.key.node_id})
    await publish(honest, stage_workers_key(run.name, 1), honest_worker.to_value())
    report = StageProgress(node_id=honest.key.node_id, step=2, samples=5)
    await publish(honest, stage_progress_key(run.name, 1), report.to_value())
    # the liar reports huge progress for the honest worker, under its own signed subkey
    forged = StageProgress(node_id=honest.key.node_id, step=900, samples=10_000)
    await publish(liar, stage_progress_key(run.name, 1), forged.to_value())
    progress = trainer("t", 40)
    own = type(progress)(**{**progress.to_value(), "node_id": liar.key.node_id})
    await publish(liar, trainer_progress_key(run.name), own.to_value())
    return report


async def test_a_record_written_for_another_node_is_flagged_and_left_out(run):
    async with members(run, 3) as (monitor, honest, liar):
        report = await publish_honest_and_forged(run, honest, liar)
        snap = await read_snapshot(monitor.dht, run)

    assert [w.node_id for w in snap.workers] == [honest.key.node_id]
    assert snap.progress[1] == [report]  # the forged report is not among them
    assert [t.node_id for t in snap.trainers] == [liar.key.node_id]  # its own report is fine
    assert [(f.subject, f.kind) for f in snap.flags] == [(honest.key.node_id, "node_id_mismatch")]
    assert liar.key.node_id[:12] in snap.flags[0].detail
    rows = Ingest(run, MonitorSettings(), Ledger(), {}).apply(snap)
    assert rows.snapshot["samples"] == 40 and rows.snapshot["workers"] == 1
    assert {r["node_id"]: r["role"] for r in rows.nodes}[honest.key.node_id] == "worker"
    assert abs(snap.t - time.time()) < 60


async def test_the_monitors_metrics_endpoint_carries_snapshots_ingest_time_flags_and_alerts(run, tmp_path):
    metrics = NodeMetrics(role="monitor", instance="test")
    store = MonitorStore(str(tmp_path / "monitor.db"))
    exposure = MetricsExposure.start(metrics, NodeSettings(metrics_port=0), run=run.name)
    try:
        async with members(run, 3) as (node, honest, liar):
            await publish_honest_and_forged(run, honest, liar)
            monitor = Monitor(run=run, store=store, dht=node.dht, settings=MonitorSettings(), metrics=metrics)
            try:
                await monitor.snapshot_once()
                store.close()  # the next snapshot cannot be written: a failed one
                with pytest.raises(MonitorDatabaseError):
                    await monitor.snapshot_once()
            finally:
                monitor.close()
        async with aiohttp.ClientSession() as session, session.get(exposure.url) as response:
            assert response.status == 200
            text = await response.text()
    finally:
        exposure.close(clean=True)
        store.close()
    node_labels = set(metrics.labels)  # role, instance, stage: on every sample
    samples = {
        (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in node_labels))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }  # fmt: skip
    assert samples[("agora_monitor_snapshots_total", (("outcome", "ok"),))] == 1
    assert samples[("agora_monitor_snapshots_total", (("outcome", "failed"),))] == 1
    assert samples[("agora_monitor_flags_total", (("kind", "node_id_mismatch"),))] == 1
    assert 0 < samples[("agora_monitor_last_snapshot_seconds", ())] < 60
    assert abs(samples[("agora_monitor_last_snapshot_timestamp_seconds", ())] - time.time()) < 60
    # tiny's 4 stages hold at most one serving worker each (< min_workers 2); the forged record
    assert samples[("agora_monitor_alerts_firing", (("name", "stage_few_workers"),))] == 4
    assert samples[("agora_monitor_alerts_firing", (("name", "record_flagged"),))] == 1
    assert samples[("agora_monitor_alerts_firing", (("name", "worker_lost"),))] == 0
