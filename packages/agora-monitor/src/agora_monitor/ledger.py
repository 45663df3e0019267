"""Counting each sample once: the running totals a run's reports add up to.

The records a run publishes are snapshots of counters, read every few seconds; the ledger
turns them into totals that count each sample once:

* A **worker** reports ``(step, samples toward that step)``. A sample is identified by the
  stage, the worker and the step it was accumulated for: the same report read twice, or a
  restarted worker's record lingering in the DHT, adds only what exceeds the most already
  seen for that ``(worker, step)``. Replicas of a stage hold distinct samples at a step (a
  trainer sends each sample to one worker per stage), so a stage's step sums its workers.
* A **stage** has done, per completed optimizer step, at least the target batch size (its
  workers step once they jointly hold it): a completed step counts ``max(target, what its
  workers were seen holding)``, the current one what they hold. Steps the monitor never saw
  (it started late; a step between two snapshots) count at the target: a lower bound.
* A **trainer** reports completed samples since its process started: a counter that drops
  is a restart, whose new counter adds from zero.
* A trainer's **receipts** (its signed report: per worker, the samples of its completed
  microbatches that worker computed) credit workers the same way, per (trainer, worker): a
  count that drops, or a trainer that restarted, adds from zero. They count for a worker only
  from a trainer it cannot be: one of another account, or of an anchor account (the
  operator's), or in an open run (no accounts at all). Each completed sample is one receipt
  per stage at most: a report whose receipts add more than its new samples times the stages
  credits nothing (and is flagged). A worker's own reports credit it nothing: the leaderboard
  counts receipts.

The ledger is the only owner of this state; the database keeps a copy (every snapshot's
rows) from which :meth:`Ledger.restore` rebuilds it after a monitor restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerCounter:
    stage: int
    step: int = -1
    step_samples: int = 0  # the most seen toward ``step``
    samples: int = 0  # the total counted for this worker
    t: float = 0.0  # when the last report was read


@dataclass
class TrainerCounter:
    reported_samples: int = 0  # the counter as last read
    reported_tokens: int = 0
    samples: int = 0  # totals across the trainer's restarts
    tokens: int = 0
    restarts: int = 0
    t: float = 0.0


@dataclass
class ReceiptCounter:
    reported: int = 0  # the trainer's count for the worker as last read
    credited: int = 0  # samples credited to the worker from this trainer, across its restarts
    counts: bool = True  # whether this trainer's receipts count for the worker (its account)


def receipt_added(counter: ReceiptCounter, reported: int, *, restarted: bool) -> int:
    """The samples a trainer's new receipt count for one worker adds: a drop, or a restart of
    the trainer, starts a new count."""
    return reported if restarted or reported < counter.reported else reported - counter.reported


@dataclass
class StageCounter:
    step: int = -1  # the furthest step any worker of the stage reported
    step_changed_t: float = 0.0
    completed_samples: int = 0  # in the steps before ``step``
    # step -> worker -> the most it was seen holding at that step (steps >= ``step`` only)
    at_step: dict[int, dict[str, int]] = field(default_factory=dict)

    @property
    def samples(self) -> int:
        return self.completed_samples + sum(self.at_step.get(self.step, {}).values())


def worker_delta(counter: WorkerCounter, step: int, samples: int) -> int:
    """Record that a worker reported ``samples`` toward ``step``; the samples not counted before.

    A lower step than before is a worker restarted from an older checkpoint: the samples it
    holds there may be ones its earlier life reported, so they add nothing until it moves on."""
    if step == counter.step:
        delta = max(0, samples - counter.step_samples)
        counter.step_samples = max(counter.step_samples, samples)
    elif step > counter.step:
        delta = samples
        counter.step, counter.step_samples = step, samples
    else:
        delta = 0
        counter.step, counter.step_samples = step, samples
    counter.samples += delta
    return delta


def trainer_delta(counter: TrainerCounter, samples: int, tokens: int) -> tuple[int, int]:
    """Record a trainer's counters; the (samples, tokens) they add. A drop is a restart."""
    if samples < counter.reported_samples or tokens < counter.reported_tokens:
        counter.restarts += 1
        delta = (samples, tokens)
    else:
        delta = (samples - counter.reported_samples, tokens - counter.reported_tokens)
    counter.reported_samples, counter.reported_tokens = samples, tokens
    counter.samples += delta[0]
    counter.tokens += delta[1]
    return delta


def advance_stage(counter: StageCounter, reports: list[tuple[str, int, int]], target: int, t: float) -> None:
    """Fold one snapshot of a stage's ``(node id, step, samples)`` reports into its counter."""
    for node_id, step, samples in reports:
        if step >= counter.step:
            held = counter.at_step.setdefault(step, {})
            held[node_id] = max(held.get(node_id, 0), samples)
    furthest = max((step for _, step, _ in reports), default=counter.step)
    if counter.step < 0 and furthest >= 0:  # first sight: the steps before it were done
        counter.completed_samples = furthest * target
        counter.step, counter.step_changed_t = furthest, t
    elif furthest > counter.step:
        for step in range(counter.step, furthest):
            counter.completed_samples += max(target, sum(counter.at_step.get(step, {}).values()))
        counter.step, counter.step_changed_t = furthest, t
    for step in [s for s in counter.at_step if s < counter.step]:
        del counter.at_step[step]


@dataclass
class Ledger:
    """Every counter of one run, keyed by node id (workers, trainers) and by stage."""

    workers: dict[str, WorkerCounter] = field(default_factory=dict)
    trainers: dict[str, TrainerCounter] = field(default_factory=dict)
    stages: dict[int, StageCounter] = field(default_factory=dict)
    receipts: dict[tuple[str, str], ReceiptCounter] = field(default_factory=dict)  # (trainer, worker)
    last_t: float | None = None  # the previous snapshot's time and trainers' token total
    last_tokens: int = 0

    @property
    def samples(self) -> int:
        """The trainers' completed samples, each counted once."""
        return sum(c.samples for c in self.trainers.values())

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.trainers.values())
