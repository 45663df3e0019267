"""One look at a run: everything its nodes publish in the DHT, read at once, checked.

:func:`read_snapshot` reads every key of the run at once (one ``get`` per key, in parallel),
keeps the records whose writer checks out
(:mod:`.records`), and notes who is a live member of the DHT: an entry a crashed node
published outlives it by up to the record TTL, its membership only until its failed probes
mark it dead, so a worker counts as live only while it is a member. A member that stopped
cleanly announced LEFT before it went: those are noted too (``Snapshot.left``), so a clean
stop is not reported as a lost worker.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from agora_core import world
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
    left: set[str] = field(default_factory=set)  # ids of members that announced leaving
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


def run_keys(run: RunConfig) -> dict[str, str]:
    """Every DHT key a run publishes under, by what it holds (``workers/2``, ``trainers``, ...)."""
    name = run.name
    keys = {"trainers": trainer_progress_key(name)}
    for stage in range(run.model.n_stages):
        keys[f"workers/{stage}"] = stage_workers_key(name, stage)
        keys[f"progress/{stage}"] = stage_progress_key(name, stage)
        keys[f"averaging/{stage}"] = averaging_summary_key(name, stage)
        keys[f"departures/{stage}"] = stage_departures_key(name, stage)
    return keys


def parse_snapshot(
    run: RunConfig,
    t: float,
    found: dict[str, dict[str, DhtValue]],
    members: dict[str, MemberInfo],
    left: set[str] = frozenset(),
) -> Snapshot:
    """The snapshot in ``found`` (what :func:`read_keys` of :func:`run_keys` returned) with the
    live ``members`` (and the ids of those that ``left``): workers and progress of live
    members only, every record checked."""
    keys = run_keys(run)
    snapshot = Snapshot(t=t, members=members, left=set(left))
    flags = snapshot.flags

    def entries(what: str, parse):
        accepted, bad = checked_entries(keys[what], found.get(keys[what], {}), parse)
        flags.extend(bad)
        return [record for record, _ in accepted]

    for stage in range(run.model.n_stages):
        # a worker announces the stage whose key it writes under; another stage is a lie
        for announcement in entries(f"workers/{stage}", WorkerAnnouncement.from_value):
            if announcement.stage != stage:
                detail = f"announced stage {announcement.stage} under stage {stage}"
                flags.append(Flag(announcement.node_id, "wrong_stage", detail))
            elif announcement.node_id in members:
                snapshot.workers.append(announcement)
        progress = entries(f"progress/{stage}", StageProgress.from_value)
        snapshot.progress[stage] = [report for report in progress if report.node_id in members]
        key = keys[f"averaging/{stage}"]
        snapshot.averaging[stage] = _averaging(key, found.get(key, {}), flags)
        snapshot.departures += entries(f"departures/{stage}", WorkerDeparture.from_value)
    snapshot.trainers = entries("trainers", TrainerProgress.from_value)
    return snapshot


async def read_keys(dht: DhtNode, keys: list[str]) -> dict[str, dict[str, DhtValue]]:
    """Every key's entries, one ``get`` per key, all at once. Not one ``get_many``: a replica
    answers that in one message, whose header (values travel in it) a large run's keys
    together outgrow (a thousand workers' announcements and reports are ~400 KB)."""
    values = await asyncio.gather(*(dht.get(key) for key in keys))
    return dict(zip(keys, values, strict=True))


async def read_snapshot(dht: DhtNode, run: RunConfig) -> Snapshot:
    """Everything run ``run`` publishes, read through ``dht`` (DhtError if it cannot read)."""
    t = world.wall()
    found = await read_keys(dht, list(run_keys(run).values()))
    return parse_snapshot(run, t, found, members_of(dht), dht.left_ids())
