"""What ``agora-authorizer accusations`` shows: every recorded accusation, grouped by the node
accused, whether it counts toward a revocation and why not, and each node's ban and pardon.

Read straight from the database (the service running or not). Whether an accusation counts
is judged as the service judges it (:func:`agora_authorizer.accusations.discount`) as of now;
the run's anchor accounts come from its config, when given.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from agora_authorizer.accusations import discount, witness
from agora_authorizer.store import Store


def accusations_report(
    store: Store,
    *,
    now: float,
    node: str | None = None,
    anchors: Collection[str] = (),
    revoke_after: int | None = None,
    anchor_checks: bool = False,
) -> dict[str, Any]:
    """The accusations (against ``node`` only, if given) by accused node: those with the
    most independent accusers first, then the most recently accused. ``revoke_after`` and
    ``anchor_checks``: the run's policy (``admission.revoke_after_accusers`` and
    ``revoke_on_anchor_spot_check``), None when the run's config is not at hand."""
    docket = store.docket(accused=node, with_banned=True)
    ban_reasons = {b.target: b.reason for b in store.bans() if b.kind == "node"}
    credentials = docket.credentials
    by_accused: dict[str, list[dict]] = {}
    for a in docket.accusations:
        why_not = discount(a, credentials, docket.pardons, anchors=anchors, now=now)
        accuser = credentials.get(a.accuser)
        by_accused.setdefault(a.accused, []).append(
            {
                "accuser": a.accuser,
                "accuser_account": None if accuser is None else accuser.account,
                "accuser_role": None if accuser is None else accuser.role,
                "accuser_stage": None if accuser is None else accuser.stage,
                "kind": a.kind,
                "rounds": a.rounds,
                "at": a.at,
                "made": a.made,
                "first_seen": a.first_seen,
                "last_seen": a.last_seen,
                "counts": why_not is None,
                "why_not": why_not,
                "witness": None if why_not is not None else witness(credentials[a.accuser], anchors),
                "evidence": a.evidence,
            }
        )
    accused = []
    for node_id, items in by_accused.items():
        items.sort(key=lambda item: (not item["counts"], -item["made"]))
        held = credentials.get(node_id)
        witnesses = sorted({item["witness"] for item in items if item["counts"]})
        accused.append(
            {
                "node_id": node_id,
                "stage": None if held is None else held.stage,
                "account": None if held is None else held.account,
                "banned": node_id in docket.banned,
                "ban_reason": ban_reasons.get(node_id),
                "pardoned": docket.pardons.get(node_id),
                "independent_accusers": len(witnesses),
                "witnesses": witnesses,
                "accusations": items,
            }
        )
    accused.sort(key=lambda n: (-n["independent_accusers"], -max(i["made"] for i in n["accusations"])))
    return {
        "database": store.url,
        "anchor_accounts": sorted(anchors),
        "revoke_after_accusers": revoke_after,
        "revoke_on_anchor_spot_check": anchor_checks and revoke_after is not None,
        "accused": accused,
    }


def _time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def format_accusations(report: dict[str, Any]) -> str:
    accused = report["accused"]
    lines = [f"database   {report['database']}"]
    total = sum(len(n["accusations"]) for n in accused)
    lines.append(f"recorded   {total} accusations against {len(accused)} nodes")
    if report["revoke_after_accusers"] is None:
        lines.append("judged     without the run's anchor accounts (give --config RUN.toml for them)")
    else:
        revoke = report["revoke_after_accusers"]
        rule = (
            f"revoked at {revoke} independent accusers"
            if revoke
            else "never revoked (revoke_after_accusers = 0)"
        )
        if revoke and report["revoke_on_anchor_spot_check"]:
            rule += ", or by one anchor trainer's spot checks"
        anchors = ", ".join(report["anchor_accounts"]) or "none"
        lines.append(f"judged     {rule}; anchor accounts: {anchors}")
    for n in accused:
        where = "no stage" if n["stage"] is None else f"stage {n['stage']}"
        lines.append("")
        lines.append(f"node {n['node_id']}  {where}, account {n['account'] or '?'}")
        standing = f"banned: {n['ban_reason']}" if n["banned"] else "not banned"
        if n["pardoned"] is not None:
            standing += f"; pardoned {_time(n['pardoned'])}"
        lines.append(f"  {standing}")
        witnesses = ", ".join(n["witnesses"])
        lines.append(
            f"  {n['independent_accusers']} independent accusers" + (f": {witnesses}" if witnesses else "")
        )
        for item in n["accusations"]:
            verdict = "counts" if item["counts"] else f"does not count: {item['why_not']}"
            account = item["accuser_account"] or "?"
            seen = "failed checks" if item["accuser_role"] == "trainer" else "rounds"
            lines.append(
                f"    by {item['accuser'][:12]} ({account}): {item['kind']}, {item['rounds']} {seen}, "
                f"last {_time(item['made'])}; {verdict}"
            )
    return "\n".join(lines)
