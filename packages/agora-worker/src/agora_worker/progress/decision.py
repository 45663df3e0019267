"""The step decision: from this worker's counts and what it knows of its peers', whether to
take its optimizer step now. Pure functions of their arguments, so every rule is tested on
exact numbers; :class:`~agora_worker.progress.tracker.StageProgressTracker` gathers the
inputs (signed DHT reports, fresher pushed counts) and acts on the answer."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from agora_core.schema import StageProgress

# How far a peer's claimed step may stand ahead of the stage's quorum step and still be heard.
# An honest worker is one step ahead after it completed a batch, a few more when its peers
# paused (serving a joiner its state, say) while it stepped on alone; they must still follow
# it, or the stage splits in two that never meet again.
MAX_STEP_LEAD = 64


@dataclass(frozen=True)
class StepDecision:
    step_now: bool  # take the optimizer step now
    behind: bool  # a peer is past this worker's step: step to catch up
    stage_step: int  # the furthest of this worker's step and the peers' reported ones
    stage_samples: int  # what the stage holds toward this worker's step
    others: int  # the peers' samples at this worker's step
    peers: int  # the peers at this worker's step
    quorum_step: int = 0  # the upper median of the live workers' steps, this one's included
    ignored: tuple[str, ...] = ()  # peers whose step claim stood too far past the quorum's


def quorum_of(steps: Iterable[int]) -> int:
    """The upper median of the steps: where most of a stage stands (of two, the one ahead),
    whatever a minority claims; 0 for none."""
    ordered = sorted(steps)
    return ordered[len(ordered) // 2] if ordered else 0


def heard_steps(steps: Mapping[str, int], *, max_lead: int = MAX_STEP_LEAD) -> dict[str, int]:
    """The claimed steps (node id -> step) no further than ``max_lead`` past their quorum."""
    quorum = quorum_of(steps.values())
    return {node: step for node, step in steps.items() if step <= quorum + max_lead}


def quorum_step(step: int, peers: Sequence[StageProgress]) -> int:
    """The quorum of this worker's and its peers' steps."""
    return quorum_of([step, *(r.step for r in peers)])


def decide_step(
    step: int, samples: int, peers: Sequence[StageProgress], target: int, *, max_lead: int = MAX_STEP_LEAD
) -> StepDecision:
    """Step when the samples of all workers at this worker's ``step`` reach the ``target``
    batch, or when a peer already moved past it. A worker with no samples of its own steps
    too: the collector may hold only its peers' counts.

    A step is a peer's own claim: one more than ``max_lead`` past the quorum step is not
    heard (a minority cannot make the stage jump far ahead at once), and is named in
    ``ignored``."""
    quorum = quorum_step(step, peers)
    ignored = tuple(r.node_id for r in peers if r.step > quorum + max_lead)
    peers = [r for r in peers if r.step <= quorum + max_lead]
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
        quorum_step=quorum,
        ignored=ignored,
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
