"""The step decision: from this worker's counts and what it knows of its peers', whether to
take its optimizer step now. Pure functions of their arguments, so every rule is tested on
exact numbers; :class:`~agora_worker.progress.tracker.StageProgressTracker` gathers the
inputs (signed DHT reports, fresher pushed counts) and acts on the answer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agora_core.schema import StageProgress


@dataclass(frozen=True)
class StepDecision:
    step_now: bool  # take the optimizer step now
    behind: bool  # a peer is past this worker's step: step to catch up
    stage_step: int  # the furthest of this worker's step and the peers' reported ones
    stage_samples: int  # what the stage holds toward this worker's step
    others: int  # the peers' samples at this worker's step
    peers: int  # the peers at this worker's step


def decide_step(step: int, samples: int, peers: Sequence[StageProgress], target: int) -> StepDecision:
    """Step when the samples of all workers at this worker's ``step`` reach the ``target``
    batch, or when a peer already moved past it. A worker with no samples of its own steps
    too: the collector may hold only its peers' counts."""
    at_step = [r for r in peers if r.step == step]
    others = sum(r.samples for r in at_step)
    stage_step = max([step, *(r.step for r in peers)])
    behind = stage_step > step
    held = samples + others
    return StepDecision(
        step_now=behind or held >= target,
        behind=behind,
        stage_step=stage_step,
        stage_samples=held,
        others=others,
        peers=len(at_step),
    )


def known_reports(
    reports: Sequence[StageProgress],
    pushes: Mapping[str, tuple[int, int, float]],
    *,
    now: float,
    fresh_s: float,
) -> list[StageProgress]:
    """The peers' reports as a worker knows them: each signed report, raised to the
    (step, samples) its worker pushed since (``pushes``: node id -> (step, samples, when
    received)), while that push is younger than ``fresh_s`` and ahead of the report. A push
    never lowers a report, and no push counts for a peer without one."""
    known = []
    for report in reports:
        pushed = pushes.get(report.node_id)
        if pushed is not None and now - pushed[2] < fresh_s and pushed[:2] > (report.step, report.samples):
            report = StageProgress(
                node_id=report.node_id, step=pushed[0], samples=pushed[1], address=report.address
            )
        known.append(report)
    return known
