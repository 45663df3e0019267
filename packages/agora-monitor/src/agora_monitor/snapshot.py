"""One look at a run: everything its nodes publish in the DHT, read at once, checked.

:func:`read_snapshot` reads every key of the run in one ``get_many`` (one request per
replica, whatever the number of stages), keeps the records whose writer checks out
(:mod:`.records`), and notes who is a live member of the DHT: an entry a crashed node
published outlives it by up to the record TTL, its membership only until its failed probes
mark it dead, so a worker counts as live only while it is a member.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from agora_core.config import RunConfig
from agora_core.dht import DhtNode, DhtValue
from agora_core.identity import node_id_from_public_key
from agora_core.schema import (
    StageProgress,
    TrainerProgress,
    WorkerAnnouncement,
    WorkerDeparture,
    averaging_summary_key,
    stage_departures_key,
    stage_progress_key,
    stage_workers_key,
    trainer_progress_key,
)
from agora_monitor.records import Flag, averaging_report, checked_entries


@dataclass(frozen=True)
class MemberInfo:
    """A live DHT member, as its credential describes it (role ``member`` in an open run)."""

    node_id: str
    address: str
    role: str
    account: str
    stage: int | None


@dataclass
class Snapshot:
    t: float  # wall-clock seconds when the read began
    workers: list[WorkerAnnouncement] = field(default_factory=list)  # live members only
    progress: dict[int, list[StageProgress]] = field(default_factory=dict)  # stage -> reports
    averaging: dict[int, list[dict]] = field(default_factory=dict)  # stage -> round reports
    departures: list[WorkerDeparture] = field(default_factory=list)
    trainers: list[TrainerProgress] = field(default_factory=list)  # live or not: final counters
    members: dict[str, MemberInfo] = field(default_factory=dict)  # node id -> member
    flags: list[Flag] = field(default_factory=list)


def members_of(dht: DhtNode) -> dict[str, MemberInfo]:
    out = {}
    for member in dht.members():
        identity = member.identity
        out[member.node_id] = MemberInfo(
            node_id=member.node_id,
            address=member.address,
            role=identity.role if identity is not None else "member",
            account=identity.account if identity is not None else "",
            stage=identity.stage if identity is not None else None,
        )
    return out


def _averaging(key: str, values: dict[str, DhtValue], flags: list[Flag]) -> list[dict]:
    reports = []
    for value in values.values():
        if value.writer is None or (value.owner is not None and value.owner != value.writer):
            flags.append(Flag("unsigned", "writer_not_owner", f"{key}: an averaging report not by its owner"))
            continue
        try:
            reports.append(averaging_report(value.value))
        except Exception as exc:  # RecordRejected: one bad report must not hide the others
            flags.append(Flag(node_id_from_public_key(value.writer), "malformed", f"{key}: {exc}"))
    return reports


async def read_snapshot(dht: DhtNode, run: RunConfig) -> Snapshot:
    """Everything run ``run`` publishes, read through ``dht`` (DhtError if it cannot read)."""
    name, stages = run.name, run.model.n_stages
    keys = {"trainers": trainer_progress_key(name)}
    for stage in range(stages):
        keys[f"workers/{stage}"] = stage_workers_key(name, stage)
        keys[f"progress/{stage}"] = stage_progress_key(name, stage)
        keys[f"averaging/{stage}"] = averaging_summary_key(name, stage)
        keys[f"departures/{stage}"] = stage_departures_key(name, stage)
    snapshot = Snapshot(t=time.time())
    found = await dht.get_many(list(keys.values()))
    snapshot.members = members_of(dht)
    live = snapshot.members.keys()
    flags = snapshot.flags
    for stage in range(stages):
        announced, bad = checked_entries(
            keys[f"workers/{stage}"], found[keys[f"workers/{stage}"]], WorkerAnnouncement.from_value
        )
        flags += bad
        # a worker announces the stage whose key it writes under; another stage is a lie
        for announcement, _ in announced:
            if announcement.stage != stage:
                flags.append(
                    Flag(
                        announcement.node_id,
                        "wrong_stage",
                        f"announced stage {announcement.stage} under stage {stage}",
                    )
                )
            elif announcement.node_id in live:
                snapshot.workers.append(announcement)
        reports, bad = checked_entries(
            keys[f"progress/{stage}"], found[keys[f"progress/{stage}"]], StageProgress.from_value
        )
        flags += bad
        snapshot.progress[stage] = [report for report, _ in reports if report.node_id in live]
        snapshot.averaging[stage] = _averaging(
            keys[f"averaging/{stage}"], found[keys[f"averaging/{stage}"]], flags
        )
        departed, bad = checked_entries(
            keys[f"departures/{stage}"], found[keys[f"departures/{stage}"]], WorkerDeparture.from_value
        )
        flags += bad
        snapshot.departures += [departure for departure, _ in departed]
    trainers, bad = checked_entries(keys["trainers"], found[keys["trainers"]], TrainerProgress.from_value)
    flags += bad
    snapshot.trainers = [report for report, _ in trainers]
    return snapshot
