"""The alerts a run has firing now, derived from what the database holds.

Each rule reads the latest state (the ``stages`` and ``nodes`` rows, the last snapshot, the
flags) and judges it at the run's own clock: the time of its last snapshot, so a run whose
monitor stopped shows what was firing when it stopped, plus ``monitor_stale`` saying so.

| name | fires when |
|---|---|
| ``stage_stalled`` | a stage's step has not moved for ``stall_after_s`` |
| ``stage_few_workers`` | a stage has fewer than ``min_workers`` serving workers |
| ``worker_lost`` | a worker vanished from the DHT: it neither announced leaving (a clean stop) nor wrote a departure record (within ``alert_window_s``) |
| ``node_terminated`` | a worker terminated itself (its departure record, within the window) |
| ``loss_nonfinite`` | a live trainer reports a NaN or infinite loss |
| ``loss_spike`` | the latest snapshot's loss is above ``loss_spike_ratio`` times the run's recent level (:func:`_loss_spike`) |
| ``samples_mismatch`` | a stage's samples and the trainers' disagree (see :mod:`.ingest`) |
| ``record_flagged`` | a record was distrusted (bad writer, impossible rate; within the window) |
| ``monitor_stale`` | no snapshot for three periods |
"""

from __future__ import annotations

import statistics

from sqlalchemy import select
from sqlalchemy.engine import Connection

from agora_core import world
from agora_monitor import schema
from agora_monitor.settings import MonitorSettings

ALERT_NAMES = (
    "stage_stalled", "stage_few_workers", "worker_lost", "node_terminated", "loss_nonfinite",
    "loss_spike", "samples_mismatch", "record_flagged", "monitor_stale",
)  # fmt: skip
STALE_PERIODS = 3  # snapshots missed before the monitor itself is reported stale


def _alert(name: str, severity: str, subject: str, message: str, since: float) -> dict:
    return {"name": name, "severity": severity, "subject": subject, "message": message, "since": since}


def _loss_spike(connection: Connection, run: str, settings: MonitorSettings, *, at: float) -> dict | None:
    """``loss_spike`` if it fires at ``at``: the latest snapshot's loss above
    ``loss_spike_ratio`` times the level, the lowest median of ``loss_spike_window``
    consecutive snapshots before it within ``alert_window_s`` (or within as many snapshot
    periods as that takes, where the window is shorter).

    Judged on the snapshots' loss, the live trainers' mean: the monitor keeps each trainer's
    latest loss only, not its history, and a broken replica poisons every trainer whose
    samples pass through it, so the mean moves with them. A median, so that one noisy
    snapshot cannot set the level; the lowest, so that a lasting spike does not become its
    own level until the window has passed (as the other alerts of that window, it then stops).
    """
    s = schema.snapshots
    span = max(settings.alert_window_s, (settings.loss_spike_window + 1) * settings.period_s)
    recent = select(s.c.t, s.c.loss).where(s.c.run == run, s.c.t >= at - span)
    rows = [tuple(row) for row in connection.execute(recent.order_by(s.c.t))]  # (t, loss)
    if not rows or rows[-1][1] is None:
        return None  # no finite loss now (a non-finite one is loss_nonfinite's)
    *before, (t, loss) = [(t, loss) for t, loss in rows if loss is not None]
    n = settings.loss_spike_window
    if len(before) < n:
        return None  # too little history to know the level
    losses = [value for _, value in before]
    level = min(statistics.median(losses[i : i + n]) for i in range(len(losses) - n + 1))
    limit = settings.loss_spike_ratio * level
    if level <= 0 or loss <= limit:
        return None
    since = t  # the first of the snapshots above the limit up to now
    for earlier, value in reversed(before):
        if value <= limit:
            break
        since = earlier
    message = (
        f"loss {loss:.2f} vs {level:.2f}, the lowest median of {n} snapshots in the previous "
        f"{span:.0f} s ({loss / level:.1f}x)"
    )
    return _alert("loss_spike", "critical", run, message, since)


def current_alerts(
    connection: Connection, run: str, settings: MonitorSettings, *, now: float | None = None
) -> list[dict]:
    """Every alert firing for ``run``, most severe first."""
    last = connection.execute(select(schema.runs.c.last_t).where(schema.runs.c.run == run)).scalar()
    if last is None:
        return []
    wall = world.wall() if now is None else now
    at = last  # the run's clock: its last snapshot
    alerts = []
    if wall - last > STALE_PERIODS * settings.period_s:
        alerts.append(_alert("monitor_stale", "warning", run, f"no snapshot for {wall - last:.0f} s", last))
    st = schema.stages
    for row in connection.execute(select(st).where(st.c.run == run).order_by(st.c.stage)).mappings():
        subject = f"stage {row['stage']}"
        idle = at - row["step_changed_t"]
        if idle >= settings.stall_after_s:
            alerts.append(_alert("stage_stalled", "critical", subject,
                                 f"no step for {idle:.0f} s (at step {row['step']})", row["step_changed_t"]))  # fmt: skip
        if row["workers_serving"] < settings.min_workers:
            alerts.append(_alert("stage_few_workers", "critical" if row["workers_serving"] == 0 else "warning",
                                 subject, f"{row['workers_serving']} serving workers (< {settings.min_workers})", at))  # fmt: skip
        if not row["reconciled"]:
            alerts.append(_alert("samples_mismatch", "warning", subject,
                                 f"stage samples differ from the trainers' by {row['samples_gap']}", at))  # fmt: skip
    n = schema.nodes
    window = at - settings.alert_window_s
    lost = select(n).where(
        n.c.run == run, n.c.role == "worker", n.c.lost_t >= window, n.c.terminated_t.is_(None)
    )
    for row in connection.execute(lost).mappings():
        alerts.append(_alert("worker_lost", "warning", row["node_id"],
                             f"worker of stage {row['stage']} vanished from the DHT without leaving or a departure record", row["lost_t"]))  # fmt: skip
    terminated = select(n).where(n.c.run == run, n.c.terminated_t >= window)
    for row in connection.execute(terminated).mappings():
        alerts.append(_alert("node_terminated", "warning", row["node_id"],
                             f"terminated itself: {row['termination_reason']} {row['termination_detail'] or ''}".strip(),
                             row["terminated_t"]))  # fmt: skip
    s = schema.snapshots
    latest = connection.execute(
        select(s.c.nonfinite_losses, s.c.t).where(s.c.run == run).order_by(s.c.t.desc()).limit(1)
    ).first()
    if latest is not None and latest[0] > 0:
        alerts.append(
            _alert(
                "loss_nonfinite", "critical", run, f"{latest[0]} trainers report a non-finite loss", latest[1]
            )
        )
    spike = _loss_spike(connection, run, settings, at=at)
    if spike is not None:
        alerts.append(spike)
    f = schema.flags
    flagged = select(f).where(f.c.run == run, f.c.last_t >= window, f.c.kind != "samples_mismatch")
    for row in connection.execute(flagged).mappings():
        alerts.append(_alert("record_flagged", "warning", row["subject"],
                             f"{row['kind']} x{row['count']}: {row['detail']}", row["first_t"]))  # fmt: skip
    order = {"critical": 0, "warning": 1}
    alerts.sort(key=lambda a: (order[a["severity"]], a["name"], a["subject"]))
    return alerts
