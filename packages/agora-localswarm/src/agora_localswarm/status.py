"""What a local swarm is doing, read from its DHT and its loss logs, and the lines that say so.

:class:`StatusReader` joins the swarm as a light DHT member and reads what the nodes publish
(workers, stage progress, averaging summaries, trainer progress); :func:`watch` prints a status
line every few seconds until the trainers are done; :func:`summarize` prints the run's loss and
throughput from the trainers' loss logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from agora_core.config import load_run_config
from agora_core.contract import Phase
from agora_core.dht import RecordRejected
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_core.schema import (
    StageProgress,
    TrainerProgress,
    WorkerAnnouncement,
    averaging_summary_key,
    parse_entries,
    stage_progress_key,
    stage_workers_key,
    trainer_progress_key,
)
from agora_localswarm import authorizer
from agora_localswarm.processes import SwarmFile, alive

T = TypeVar("T")


def averaging_summary(value: Any) -> dict:
    """A worker's averaging summary: any map (its fields are read one by one, each checked)."""
    if not isinstance(value, dict):
        raise RecordRejected("an averaging summary must be a map")
    return dict(value)


def light_member(swarm: SwarmFile) -> dict:
    """RunNode settings of a light member of the swarm: a fresh key, bootstrapped to its seed,
    and in an authorized swarm a monitor credential from its authorizer."""
    key, credential = NodeKey.generate(), None
    if swarm.authorized:
        credential = authorizer.operator_credential(Path(swarm.run_dir), swarm.config, key, "monitor")
    return {
        "run": load_run_config(swarm.config),
        "key": key,
        "metrics": NodeMetrics(role="monitor"),
        "bootstrap": [swarm.seed_address],
        "credential": credential,
    }


class StatusReader:
    """A light DHT member of the swarm that reads what the nodes publish (in an authorized
    swarm with a monitor credential of its own, from the swarm's authorizer)."""

    def __init__(self, swarm: SwarmFile):
        settings = light_member(swarm)
        self.run = settings["run"]
        self.run_node = RunNode(**settings)
        self.node = self.run_node.dht
        self._last: tuple[float, int] | None = None

    async def __aenter__(self) -> StatusReader:
        await self.run_node.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.run_node.stop()

    async def _values(self, key: str, parse: Callable[[Any], T]) -> list[T]:
        """The entries under ``key`` that ``parse`` accepts; none while the DHT does not answer."""
        try:
            values = await self.node.get(key)
        except (AgoraError, TimeoutError):
            return []
        return parse_entries(values, parse)

    async def snapshot(self) -> dict:
        name, stages = self.run.name, self.run.model.n_stages
        workers, joining, steps, averaging = [], [], [], []
        for stage in range(stages):
            announced = await self._values(stage_workers_key(name, stage), WorkerAnnouncement.from_value)
            syncing = sum(a.phase is not Phase.SERVING for a in announced)
            workers.append(len(announced) - syncing)
            joining.append(syncing)
            progress = await self._values(stage_progress_key(name, stage), StageProgress.from_value)
            steps.append(max((p.step for p in progress), default=0))
            summaries = await self._values(averaging_summary_key(name, stage), averaging_summary)
            averaging.extend(s.get("averaging_success") for s in summaries)
        trainers = await self._values(trainer_progress_key(name), TrainerProgress.from_value)
        tokens = sum(t.tokens for t in trainers)
        now = time.monotonic()
        rate = None
        if self._last is not None and now > self._last[0]:
            rate = (tokens - self._last[1]) / (now - self._last[0])
        self._last = (now, tokens)
        losses = [t.loss_ema for t in trainers if t.loss_ema is not None]
        averaged = [a for a in averaging if isinstance(a, (int, float))]
        return {
            "steps": steps,
            "workers": workers,
            "joining": joining,
            "samples": sum(t.samples for t in trainers),
            "loss": sum(losses) / len(losses) if losses else None,
            "tokens_per_s": rate,
            "averaging_success": sum(averaged) / len(averaged) if averaged else None,
        }


def format_status(s: dict, elapsed: float) -> str:
    loss = "-" if s["loss"] is None else f"{s['loss']:.3f}"
    rate = "-" if s["tokens_per_s"] is None else f"{s['tokens_per_s']:.0f}"
    avg = "-" if s["averaging_success"] is None else f"{s['averaging_success']:.2f}"
    joining = s.get("joining") or [0] * len(s["workers"])
    workers = ", ".join(f"{n}+{j}" if j else str(n) for n, j in zip(s["workers"], joining, strict=True))
    legend = " (+ joining: downloading or syncing)" if any(joining) else ""
    return (
        f"[{elapsed:6.0f} s] step/stage {s['steps']}  loss {loss}  tokens/s {rate}  "
        f"samples {s['samples']}  workers/stage [{workers}]{legend}  averaging {avg}"
    )


async def watch(
    swarm: SwarmFile,
    trainers: list[subprocess.Popen],
    started: float,
    duration: float | None,
    interval: float,
) -> None:
    """A status line every ``interval`` s until the trainers exit or ``duration`` s pass."""
    async with StatusReader(swarm) as reader:
        while True:
            deadline = time.monotonic() + interval
            while time.monotonic() < deadline:
                if all(p.poll() is not None for p in trainers):
                    click.echo(format_status(await reader.snapshot(), time.monotonic() - started))
                    click.echo("trainers finished")
                    return
                if duration is not None and time.monotonic() - started > duration:
                    click.echo(f"--duration {duration:g} s reached")
                    return
                await asyncio.sleep(0.2)
            click.echo(format_status(await reader.snapshot(), time.monotonic() - started))


def describe_swarm(swarm) -> list[str]:
    """``swarm.py status``: the swarm's processes (role, name, stage, pid, address), its
    authorizer with the nodes it admitted, and one status line read from its DHT."""
    run_dir = Path(swarm.run_dir)
    lines = [f"swarm in {run_dir}: config {swarm.config}", f"  dht seed   {swarm.seed_address or '-'}"]
    if swarm.authorized:
        admitted = authorizer.admitted(run_dir)
        if admitted is None:
            count = "admitted: unknown (its database cannot be read)"
        else:
            stages = ", ".join(f"{s}: {n}" for s, n in admitted["workers_per_stage"].items()) or "none"
            count = (
                f"admitted {sum(admitted['by_role'].values())} nodes with a live credential"
                f" (workers per stage {stages})"
            )
        lines.append(f"  authorizer {swarm.authorizer_address or '-'}   {count}")
    else:
        lines.append("  admission  open: no authorizer")
    for m in swarm.members:
        state = "running" if m.alive and alive(m.pid, m.started) else "stopped"
        stage = "" if m.stage is None else f"stage {m.stage}"
        lines.append(f"  {m.role:<10} {m.name:<11} {stage:<8} pid {m.pid:<7} {state:<8} {m.address}")
    running = any(m.role == "dht" and m.alive and alive(m.pid, m.started) for m in swarm.members)
    if running and swarm.seed_address:

        async def once() -> dict:
            async with StatusReader(swarm) as reader:
                return await reader.snapshot()

        with contextlib.suppress(AgoraError, TimeoutError, OSError):
            lines.append(format_status(asyncio.run(once()), 0.0).split("] ", 1)[1])
    return lines


def summarize(run_dir: Path, started: float, seq_len: int) -> float | None:
    """The run's loss, first samples against last, and its throughput, from the loss logs;
    returns the throughput in samples/s (None: too few samples to tell)."""
    records = []
    for path in sorted(run_dir.glob("trainer-*.losses.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                record = json.loads(line)
                records.append((record["t"], record["loss"]))
    records.sort()
    losses = [loss for _, loss in records]
    if not losses:
        click.echo("no samples completed")
        return None
    window = max(1, min(64, len(losses) // 4))
    first = sum(losses[:window]) / window
    last = sum(losses[-window:]) / window
    click.echo(
        f"done in {time.monotonic() - started:.0f} s: {len(losses)} samples, "
        f"loss {first:.3f} (first {window}) -> {last:.3f} (last {window})"
    )
    if len(records) > 1 and records[-1][0] > records[0][0]:
        rate = (len(records) - 1) / (records[-1][0] - records[0][0])
        click.echo(f"training throughput: {rate:.1f} samples/s, {rate * seq_len:.0f} tokens/s")
        return rate
    return None
