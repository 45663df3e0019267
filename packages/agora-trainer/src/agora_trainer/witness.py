"""The trainer as witness of its workers: a replica whose samples fare far worse than the
samples its stage's other replicas served over the same period is a loss outlier.

A trainer routes every microbatch, so it sees what no worker reports about itself: the loss
each replica's weights led to (ARCHITECTURE.md section 11). Each completed microbatch's
per-sample losses are recorded against the worker that served it at every stage (the forward
worker of each non-tail stage, the tail's worker). A replica wrecked by one bad optimizer step
shows as a stage worker whose samples' losses jump while its peers' do not.

The rule. The trainer's samples are numbered as they complete and cut into periods of
``period_samples``; the window is the last ``window_periods`` periods. Worker ``w`` of stage
``s`` is an outlier when, counting only the periods in which both ``w`` and another worker of
``s`` served samples (matched periods)::

    n_w >= min_samples  and  n_others >= min_samples  and  mean_w > ratio x mean_others

where ``mean_w`` is the mean loss of w's samples in those periods and ``mean_others`` the mean,
over the same samples of w, of the other workers' mean loss in the sample's period (the
others' samples weighted to w's spread over time). Why so:

* Only within a stage: every replica of a stage has the same job, and each other stage's
  balancer draws its workers for the samples whichever replica served them here (where
  routing pairs them anyway, see below).
* Matched periods: the loss falls over a run, so a worker whose samples are older than its
  peers' (it was away, or banned, for part of the window) would otherwise look worse for
  being earlier. Within a period the loss hardly moves.
* ``min_samples`` on both sides: per-sample losses are noisy; with one worker in the stage
  there are no others and never a verdict.
* The window bounds memory whatever node ids come and go: a worker that left ages out with
  its periods.
* A non-finite loss counts as infinitely bad.

Blame that belongs elsewhere. A wrecked tail replica raises the loss of every sample routed
through it, whichever head replica served that sample; if routing happened to pair one head
replica with it more often, that replica would look worse too. So for each other stage the
rule is evaluated again within strata of (period, worker at that stage): where that has
``min_samples`` on both sides and no longer holds, the worker is cleared (its excess came with
the workers it met there); where it has too few samples to tell, the verdict waits while a
worker it met there has a larger excess than its own (the culprit's excess is undiluted, so
it is judged first). When one microbatch brings several verdicts, the largest excess goes
first and every sample that went through its worker is forgotten (it is no evidence about
anyone) before the others are judged again. Routes paired so fully that nothing tells two
workers apart condemn one of them; once it is excluded the routes change and the evidence
tells. A condemned worker is forgotten the same way: once trusted again, it is judged afresh
on new samples.

This is local routing, not an accusation: the trainer stops sending its own microbatches to
the worker for a while (the router and ``StageBalancer.distrust``); nothing is published.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from agora_core.config import require

# A worker whose samples' mean loss exceeds this x its stage peers' is an outlier. Far above
# the noise of a mean of MIN_SAMPLES sample losses (each a mean over seq_len tokens), far
# below what a wrecked replica produces.
OUTLIER_RATIO = 1.5
MIN_SAMPLES = 16  # samples needed on each side (the worker's, its peers') for a verdict
DISTRUST_S = 60.0  # an outlier gets no new microbatch this long, then is judged afresh


@dataclass(kw_only=True, frozen=True)
class WitnessConfig:
    ratio: float = OUTLIER_RATIO  # mean loss over the peers' for an outlier
    min_samples: int = MIN_SAMPLES  # on each side, for any verdict
    period_samples: int = 32  # completed samples per period: compared only within one
    window_periods: int = 16  # periods kept: the recent window (512 samples by default)

    def __post_init__(self) -> None:
        require(self.ratio > 1.0, "ratio", "must be > 1 (else a worker at the mean is one)")
        for name in ("min_samples", "period_samples", "window_periods"):
            require(getattr(self, name) >= 1, name, "must be >= 1")


@dataclass(frozen=True)
class Outlier:
    """A verdict: ``node_id`` at ``stage`` fared ``mean_loss`` where its peers fared
    ``others_mean_loss``, on ``samples`` and ``others_samples`` samples of matched periods."""

    stage: int
    node_id: str
    mean_loss: float
    others_mean_loss: float
    samples: int
    others_samples: int

    @property
    def excess(self) -> float:
        """mean_loss / others_mean_loss (inf where the others' is 0)."""
        return self.mean_loss / self.others_mean_loss if self.others_mean_loss > 0 else math.inf


@dataclass(frozen=True)
class _Served:
    """One microbatch: who served it at each stage, its summed losses, how many samples."""

    served: tuple[str, ...]
    loss_sum: float
    samples: int


@dataclass(eq=False)
class _Period:
    index: int
    stages: int
    microbatches: list[_Served] = field(default_factory=list)
    # Per stage: node id -> [loss sum, samples], kept as microbatches arrive (judged each time).
    sums: list[dict[str, list[float]]] = field(init=False)

    def __post_init__(self) -> None:
        self.sums = [{} for _ in range(self.stages)]

    def add(self, mb: _Served) -> None:
        self.microbatches.append(mb)
        for stage, node_id in enumerate(mb.served):
            total = self.sums[stage].setdefault(node_id, [0.0, 0])
            total[0] += mb.loss_sum
            total[1] += mb.samples

    def drop(self, stage: int, node_id: str) -> None:
        """Forget every microbatch ``node_id`` served at ``stage``."""
        if node_id not in self.sums[stage]:
            return
        kept = [mb for mb in self.microbatches if mb.served[stage] != node_id]
        self.microbatches = []
        self.sums = [{} for _ in range(self.stages)]
        for mb in kept:  # rebuilt rather than subtracted: no drift, and it is rare
            self.add(mb)


# One stratum of a comparison: (the worker's loss sum, its samples, the others' sum, theirs).
_Stratum = tuple[float, int, float, int]


class LossWitness:
    """Per-sample losses of the last microbatches, by the worker that served each stage."""

    def __init__(self, stages: int, config: WitnessConfig | None = None):
        if stages < 1:
            raise ValueError(f"a pipeline has at least one stage, not {stages}")
        self.stages = stages
        self.config = config or WitnessConfig()
        self._periods: deque[_Period] = deque()
        self._completed = 0  # samples recorded so far: the clock periods are cut from

    def record(self, served: Sequence[str], losses: Sequence[float] | np.ndarray) -> list[Outlier]:
        """A microbatch completed: ``served[s]`` is the node id of its worker at stage ``s``,
        ``losses`` (B,) its samples' losses. Returns the workers it shows to be outliers (each
        then forgotten, so it is judged afresh on later samples)."""
        if len(served) != self.stages:
            raise ValueError(f"a microbatch is served at {self.stages} stages, not {len(served)}")
        values = np.asarray(losses, dtype=np.float64).reshape(-1)  # (B,)
        if values.size == 0:
            raise ValueError("a microbatch has at least one sample's loss")
        values = np.where(np.isfinite(values), values, np.inf)  # NaN included: infinitely bad
        self._period_now().add(_Served(tuple(served), float(values.sum()), int(values.size)))
        self._completed += int(values.size)
        verdicts: list[Outlier] = []
        pending = dict(enumerate(served))
        while pending:
            found = [v for stage, node_id in pending.items() if (v := self._judge(stage, node_id))]
            if not found:
                break
            worst = max(found, key=lambda v: v.excess)
            verdicts.append(worst)
            self._forget(worst.stage, worst.node_id)
            del pending[worst.stage]
        return verdicts

    def _forget(self, stage: int, node_id: str) -> None:
        """Forget every microbatch ``node_id`` served at ``stage`` (for all stages' verdicts)."""
        for period in self._periods:
            period.drop(stage, node_id)

    def samples(self, stage: int, node_id: str) -> int:
        """Samples of the window that ``node_id`` served at ``stage``."""
        return sum(int(p.sums[stage].get(node_id, (0.0, 0))[1]) for p in self._periods)

    def node_ids(self, stage: int) -> set[str]:
        """The workers of ``stage`` that served a sample of the window."""
        return {node_id for p in self._periods for node_id in p.sums[stage]}

    def _period_now(self) -> _Period:
        index = self._completed // self.config.period_samples
        if not self._periods or self._periods[-1].index != index:
            self._periods.append(_Period(index, self.stages))
        while self._periods[0].index <= index - self.config.window_periods:
            self._periods.popleft()  # aged out, with whoever served it
        return self._periods[-1]

    def _judge(self, stage: int, node_id: str) -> Outlier | None:
        found = self._evidence(stage, node_id, self._by_period(stage, node_id))
        if found is None or not self._condemns(found):
            return None
        for other in range(self.stages):
            if other == stage:
                continue
            key = lambda mb, o=other: mb.served[o]  # noqa: E731 - the stratum: who served stage o
            controlled = self._evidence(stage, node_id, self._by_period_and(stage, node_id, key))
            if controlled is not None and self._sufficient(controlled):
                if not self._condemns(controlled):
                    return None  # its excess came with the workers it met at stage `other`
            elif any(self._excess(other, met) > found.excess for met in self._met(stage, node_id, other)):
                return None  # too few samples to tell, and one it met there fares worse: that one first
        return found

    def _met(self, stage: int, node_id: str, other: int) -> set[str]:
        """The workers of stage ``other`` that served samples ``node_id`` served at ``stage``."""
        return {
            mb.served[other] for p in self._periods for mb in p.microbatches if mb.served[stage] == node_id
        }

    def _excess(self, stage: int, node_id: str) -> float:
        found = self._evidence(stage, node_id, self._by_period(stage, node_id))
        return 0.0 if found is None else found.excess

    def _by_period(self, stage: int, node_id: str) -> list[_Stratum]:
        strata = []
        for period in self._periods:
            by_node = period.sums[stage]
            mine = by_node.get(node_id)
            if mine is None:
                continue
            others_sum = others_n = 0.0
            for other, (loss_sum, samples) in by_node.items():
                if other != node_id:
                    others_sum += loss_sum
                    others_n += samples
            strata.append((mine[0], int(mine[1]), others_sum, int(others_n)))
        return strata

    def _by_period_and(self, stage: int, node_id: str, key: Callable[[_Served], str]) -> list[_Stratum]:
        strata = []
        for period in self._periods:
            groups: dict[str, list[float]] = {}
            for mb in period.microbatches:
                group = groups.setdefault(key(mb), [0.0, 0, 0.0, 0])
                side = 0 if mb.served[stage] == node_id else 2
                group[side] += mb.loss_sum
                group[side + 1] += mb.samples
            strata.extend((g[0], int(g[1]), g[2], int(g[3])) for g in groups.values())
        return strata

    def _sufficient(self, found: Outlier) -> bool:
        least = self.config.min_samples
        return found.samples >= least and found.others_samples >= least

    def _condemns(self, found: Outlier) -> bool:
        return self._sufficient(found) and found.mean_loss > self.config.ratio * found.others_mean_loss

    @staticmethod
    def _evidence(stage: int, node_id: str, strata: Iterable[_Stratum]) -> Outlier | None:
        """The worker's mean loss and the others', over the strata in which both served
        samples (the others' weighted to the worker's samples); None: no such stratum."""
        mine_sum = others_weighted = 0.0
        mine_n = others_n = 0
        for s_sum, s_n, o_sum, o_n in strata:
            if not s_n or not o_n:
                continue
            mine_sum += s_sum
            mine_n += s_n
            others_weighted += s_n * (o_sum / o_n)  # the others' mean there, weighted by w's samples
            others_n += o_n
        if not mine_n:
            return None
        return Outlier(stage, node_id, mine_sum / mine_n, others_weighted / mine_n, mine_n, others_n)
