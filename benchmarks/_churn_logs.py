"""What a churn soak's run directory says: its trainer's loss log, and its nodes' log lines.

Every node of the swarm logs to RUN_DIR/logs/<name>.log (console format); the trainer
appends one JSON line per completed sample to RUN_DIR/trainer-0.losses.jsonl, flushed as it
goes, across its restarts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from _churn_swarm import DrivenSwarm
from agora_core.config import RunConfig
from agora_trainer.data.cursor import reading_order
from agora_trainer.data.shards import open_shards


def read_losses(path: Path) -> list[dict]:
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line cut by a crash
    return sorted(records, key=lambda r: r["t"])


def sample_order(shards: Path, run: RunConfig) -> list[int]:
    """The sample ids in the order a trainer reading every shard takes them (data.shuffle_seed)."""
    return reading_order(open_shards(shards), run.model.seq_len, run.data.shuffle_seed)


def sample_figures(
    records: list[dict], abandoned: set[int], order: list[int], until: float | None = None
) -> dict:
    """What the loss log says; the rate is over [first completion, ``until``] (default: the
    last completion), so a trainer that stalls before the end is not flattered. ``order``: the
    ids in the order the trainer takes them: every one before the last completed is expected."""
    ids = [r["id"] for r in records]
    unique = set(ids)
    place = {sample_id: i for i, sample_id in enumerate(order)}
    expected = set(order[: max(place[i] for i in unique) + 1]) if unique else set()
    first = {}
    for r in records:
        first.setdefault(r["id"], r)
    ordered = sorted(first.values(), key=lambda r: r["t"])
    end = ordered[-1]["t"] if until is None or not ordered else until
    done = sum(1 for r in ordered if r["t"] <= end)
    span = end - ordered[0]["t"] if ordered else 0.0
    return {
        "completed": len(unique),
        "twice": len(ids) - len(unique),
        "lost": len(expected - unique),
        "abandoned": len(abandoned),
        "samples_per_s": (done - 1) / span if span > 0 else 0.0,
        "losses": [r["loss"] for r in ordered],
    }


def log_lines(paths: list[Path], event: str) -> list[str]:
    return [line for path in paths for line in path.read_text(errors="replace").splitlines() if event in line]


def rounds(paths: list[Path]) -> tuple[int, int]:
    """(rounds attempted, rounds completed) over every worker's round reports: attempted when
    a group of two or more formed or matchmaking failed; completed when all of the segment
    came back."""
    attempted = completed = 0
    for line in log_lines(paths, "averaging_round "):
        size = re.search(r"group_size=(\d+)", line)
        success = re.search(r"averaging_success=([0-9.]+)", line)
        failed = "matchmaking_failed=True" in line
        if size and success and (int(size.group(1)) >= 2 or failed):
            attempted += 1
            completed += float(success.group(1)) >= 0.999
    return attempted, completed


def abandoned_ids(swarm: DrivenSwarm) -> set[int]:
    found = set()
    for line in log_lines(swarm.logs("trainer"), "sample_abandoned"):
        match = re.search(r"sample=(\d+)", line)
        if match:
            found.add(int(match.group(1)))
    return found


def last_loss(losses: list[float], count: int) -> float:
    """The mean loss of the last tenth (at least 16) of the first ``count`` samples; 0 without
    any (a run too short to complete one)."""
    window = max(16, count // 10)
    tail = losses[:count][-window:]
    return sum(tail) / len(tail) if tail else 0.0
