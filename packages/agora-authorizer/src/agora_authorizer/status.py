"""What ``agora-authorizer status`` shows: the queue, who is admitted where, why others were not.

Read straight from the database, so it works with the service running or not, from any
machine that can open the database.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from agora_authorizer.store import Store


def status_report(store: Store, *, now: float) -> dict[str, Any]:
    live = store.live_credentials(now=now)
    per_stage: Counter[int] = Counter(c.stage for c in live if c.role == "worker" and c.stage is not None)
    per_role: Counter[str] = Counter(c.role for c in live)
    queued = store.queued()
    return {
        "database": store.url,
        "queue": [
            {
                "request_id": r.id,
                "node_id": r.node_id,
                "role": r.role,
                "stage": r.stage,
                "waited_s": now - r.received,
            }
            for r in queued
        ],
        "admitted": {"workers_per_stage": dict(sorted(per_stage.items())), "by_role": dict(per_role)},
        "nodes": [
            {
                "node_id": c.node_id,
                "role": c.role,
                "stage": c.stage,
                "account": c.account,
                "serial": c.serial,
                "expires_in_s": c.expires - now,
            }
            for c in sorted(live, key=lambda c: (c.role, c.stage if c.stage is not None else -1, c.node_id))
        ],
        "requests": store.requests_by_status(),
        "refusals": store.refusals_by_reason(),
        "bans": [{"kind": b.kind, "target": b.target, "reason": b.reason} for b in store.bans()],
    }


def format_status(report: dict[str, Any]) -> str:
    lines = [f"database   {report['database']}"]
    if report.get("address"):
        lines.append(f"serving    {report['address']}")
    admitted = report["admitted"]
    stages = ", ".join(f"stage {s}: {n}" for s, n in admitted["workers_per_stage"].items()) or "none"
    lines.append(f"admitted   {sum(admitted['by_role'].values())} nodes with a live credential")
    lines.append(f"  workers  {stages}")
    for role, count in sorted(admitted["by_role"].items()):
        if role != "worker":
            lines.append(f"  {role}s {count}")
    lines.append(f"queue      {len(report['queue'])} waiting")
    for position, item in enumerate(report["queue"], 1):
        stage = "" if item["stage"] is None else f" -> stage {item['stage']}"
        lines.append(
            f"  {position:>3}. {item['node_id'][:12]} {item['role']}{stage}, waited {item['waited_s']:.0f} s"
        )
    requests = ", ".join(f"{k} {v}" for k, v in sorted(report["requests"].items())) or "none"
    lines.append(f"requests   {requests}")
    refusals = ", ".join(f"{k} {v}" for k, v in sorted(report["refusals"].items(), key=lambda kv: -kv[1]))
    lines.append(f"refusals   {refusals or 'none'}")
    for node in report["nodes"]:
        where = f"stage {node['stage']}" if node["stage"] is not None else node["role"]
        lines.append(
            f"  node {node['node_id'][:12]} {where:<8} account {node['account']}, "
            f"credential {node['serial']} for {node['expires_in_s']:.0f} s"
        )
    if report["bans"]:
        lines.append("bans       " + ", ".join(f"{b['kind']} {b['target'][:16]}" for b in report["bans"]))
    return "\n".join(lines)
