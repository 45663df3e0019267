"""Spot checks, the rules: which hops to check, how far apart honest replicas' outputs stand,
which replica a third one's answer settles against, and whom the trainer accuses.

The trainer routes every microbatch, so it can ask a second replica of a stage the very
question it asked the first (``agora_trainer.checking`` makes the calls). Two kinds of check:

* ``forward``: the same tokens and input boundary to a ``forward`` (at the tail, its losses).
  A forward keeps nothing on a worker, so neither the worker checked nor the one checking can
  tell a check from work.
* ``gradient``: a backward's input gradient (at the tail, ``forward_backward``'s losses and
  gradient), asked of the second replica as ``gradient``, which computes it without training.
  It costs about three forwards, so it is made a third as often (``GRADIENT_COST``).

The measure is the relative distance of the two outputs, ``|a - b| / max(|a|, |b|)`` over
the whole microbatch (a non-finite output or a wrong shape: infinitely far; of several
outputs, the largest). Honest replicas are not identical: each takes local steps between
averaging rounds, and early in a run their outputs may stand far apart. So each stage's
tolerance, per kind of check, is learned: ``tolerance_factor`` x the median distance of the
closest pair of replicas (the pair with the smallest median over its last ``PAIR_HISTORY``
checks, once it has ``pair_checks``), at least ``min_tolerance``. Until some pair has that
many, a stage's checks only measure. The closest pair, not all pairs: a liar stands in most
pairs of a small stage, and one that stays just inside the tolerance must not drag it
upwards. A stage whose honest replicas stand as far apart as unrelated outputs (about 1.4)
cannot tell a liar by its output; the tolerance (a gauge) says so.

A mismatch alone says nothing about who is wrong. A third replica is asked: when exactly one
pair of the three agrees, the other is the odd one out; otherwise (no third replica, or no
single agreeing pair) the check stays unresolved. The odd one is distrusted for a while (no
new microbatch; see ``StageBalancer.distrust``), and after ``accuse_after`` settled
mismatches the trainer accuses it of ``compute_output`` in the DHT, with the checks as
evidence (:mod:`agora_core.admission.accusations`). When the odd one was the hop's own
worker, its answer is not used (``agora_trainer.checking``).
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.admission.accusations import (
    MAX_ACCUSED,
    MAX_EVIDENCE,
    Accusation,
    AccuserRecord,
    CheckEvidence,
)
from agora_core.config import require
from agora_core.wire.dtypes import Tensor, as_float32
from agora_trainer.balancer import WorkerRef

# Of the hops at each stage, the fraction forward-checked; a third as many are gradient-checked.
# A hop's work is about four forwards (the forward, then the backward's recompute and its two
# forwards' worth of gradients): the checks add (f + 3 f / 3) / 4 = f / 2, 3 % at 0.06.
CHECK_FRACTION = 0.06
GRADIENT_COST = 3  # a gradient check's cost in forwards
KINDS = ("forward", "gradient")
PAIR_HISTORY = 32  # distances kept per pair of replicas
MAX_PAIRS = 64  # pairs remembered per stage; the least recently checked go first


@dataclass(kw_only=True, frozen=True)
class SpotCheckConfig:
    fraction: float = CHECK_FRACTION  # 0: no spot checks
    # x the closest pair's median distance: room for the honest spread above the median, which
    # is wide where replicas of a small model take large local steps (benchmarks/byzantine.py)
    tolerance_factor: float = 3.0
    # below this, outputs always agree: bf16 rounding, and a tail's few per-sample losses,
    # whose honest differences have long tails; zero or random outputs stand at 1 or more
    min_tolerance: float = 0.2
    pair_checks: int = 8  # checks of a pair before its median counts
    accuse_after: int = 3  # settled mismatches before the trainer accuses in the DHT (0: never)

    def __post_init__(self) -> None:
        require(0.0 <= self.fraction <= 1.0, "fraction", "must lie in [0, 1]")
        require(self.tolerance_factor >= 1.0, "tolerance_factor", "must be >= 1")
        require(self.min_tolerance > 0.0, "min_tolerance", "must be positive")
        require(self.pair_checks >= 1, "pair_checks", "must be >= 1")
        require(self.accuse_after >= 0, "accuse_after", "must be >= 0")


Outputs = dict[str, Tensor]  # one replica's answer: output name -> tensor


def distance(a: Tensor | Outputs, b: Tensor | Outputs) -> float:
    """The relative distance of two outputs: 0 equal, about 1 unrelated, inf unusable; of two
    answers of several outputs, the largest of their outputs' distances."""
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or a.keys() != b.keys():
            return math.inf
        return max((distance(a[name], b[name]) for name in a), default=0.0)
    x, y = as_float32(a).astype(np.float64), as_float32(b).astype(np.float64)
    if x.shape != y.shape or not (np.isfinite(x).all() and np.isfinite(y).all()):
        return math.inf
    scale = max(float(np.linalg.norm(x)), float(np.linalg.norm(y)))
    return 0.0 if scale == 0.0 else float(np.linalg.norm(x - y)) / scale


@dataclass
class StageTolerance:
    """How far apart one stage's honest replicas' outputs stand: per pair, its recent
    distances (none where a check settled against one of the two)."""

    config: SpotCheckConfig
    pairs: collections.OrderedDict[tuple[str, str], collections.deque[float]] = field(
        default_factory=collections.OrderedDict
    )

    def measured(self, a: str, b: str, measured: float) -> None:
        pair = (a, b) if a < b else (b, a)
        kept = self.pairs.pop(pair, None) or collections.deque(maxlen=PAIR_HISTORY)
        kept.append(measured)
        self.pairs[pair] = kept  # the most recently checked last
        while len(self.pairs) > MAX_PAIRS:
            self.pairs.popitem(last=False)

    def checked(self, a: str, b: str) -> int:
        """Distances kept of the pair ``a``, ``b``."""
        return len(self.pairs.get((a, b) if a < b else (b, a), ()))

    def forget(self, node_id: str) -> None:
        """Drop every pair ``node_id`` stands in (its agreements are no evidence now)."""
        for pair in [p for p in self.pairs if node_id in p]:
            del self.pairs[pair]

    def value(self) -> float | None:
        """The tolerance; None while no pair has ``pair_checks`` distances."""
        config = self.config
        medians = [statistics.median(d) for d in self.pairs.values() if len(d) >= config.pair_checks]
        if not medians:
            return None
        return max(config.min_tolerance, config.tolerance_factor * min(medians))


@dataclass(frozen=True)
class Mismatch:
    """A settled spot check: ``odd`` stood apart from two replicas that agreed."""

    odd: str
    agreeing: tuple[str, str]
    evidence: CheckEvidence  # its stage among the rest


def settle(
    outputs: dict[str, Tensor | Outputs], tolerance: float
) -> tuple[str, tuple[str, str], float, float] | None:
    """Three replicas' outputs: (odd one, the agreeing pair, the odd one's distance to the
    nearer of them, the pair's distance) when exactly one pair agrees, else None."""
    if len(outputs) != 3:
        raise ValueError(f"a mismatch is settled among 3 replicas, not {len(outputs)}")
    ids = sorted(outputs)
    far = {(a, b): distance(outputs[a], outputs[b]) for i, a in enumerate(ids) for b in ids[i + 1 :]}
    agreeing = [pair for pair, measured in far.items() if measured <= tolerance]
    if len(agreeing) != 1:
        return None
    pair = agreeing[0]
    (odd,) = set(ids) - set(pair)
    measured = min(far[tuple(sorted((odd, other)))] for other in pair)
    return odd, pair, measured, far[pair]


@dataclass
class _Failed:
    checks: collections.deque[CheckEvidence]
    total: int = 0
    at: float = 0.0


class SpotChecker:
    """A trainer's spot checks: which to make, each stage's tolerance, and whom they accuse."""

    def __init__(self, config: SpotCheckConfig, stages: int, *, node_id: str, seed: object = None):
        self.config = config
        self.node_id = node_id
        self._rng = world.rng(seed)
        self._tolerance = {(s, kind): StageTolerance(config) for s in range(stages) for kind in KINDS}
        self._failed: dict[str, _Failed] = {}  # node id -> the checks it failed
        self.accused: dict[str, float] = {}  # node id -> when this trainer accused it
        self.serial = 0  # checks made: each one's number

    def due(self, kind: str) -> bool:
        """Whether this hop of this microbatch gets a check of ``kind``."""
        fraction = self.config.fraction / (GRADIENT_COST if kind == "gradient" else 1)
        return fraction > 0 and self._rng.random() < fraction

    def pick(self, stage: int, kind: str, primary: str, candidates: Sequence[WorkerRef]) -> WorkerRef | None:
        """The replica asked to check ``primary``'s output: of those whose pair with it was
        checked least (so every pair, the honest one among them, is measured alike), one at
        random."""
        if not candidates:
            return None
        checked = self._tolerance[stage, kind].checked
        fewest = min(checked(primary, c.node_id) for c in candidates)
        return self._rng.choice([c for c in candidates if checked(primary, c.node_id) == fewest])

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def tolerance(self, stage: int, kind: str) -> float | None:
        """How far apart two replicas' outputs may stand and agree (None: not learned yet)."""
        return self._tolerance[stage, kind].value()

    def measured(self, stage: int, kind: str, a: str, b: str, distance: float) -> None:
        """A check that settled against neither: ``distance`` is how far honest ones stand."""
        self._tolerance[stage, kind].measured(a, b, distance)

    def settle(
        self, stage: int, kind: str, check: int, outputs: dict[str, Tensor | Outputs], tolerance: float
    ) -> Mismatch | None:
        """Three replicas' outputs after a mismatch: the odd one, if the check settles it (its
        pairs are forgotten, the agreeing pair's distance counts as honest)."""
        found = settle(outputs, tolerance)
        if found is None:
            return None
        odd, pair, measured, agreed = found
        for known in KINDS:  # wrong in one kind of answer, it is no measure of honest ones
            self._tolerance[stage, known].forget(odd)
        self._tolerance[stage, kind].measured(*pair, agreed)
        measured = min(measured, np.finfo(np.float32).max)  # an infinite one, as a number the record holds
        evidence = CheckEvidence(check, stage, measured, agreed, tolerance)
        return Mismatch(odd, pair, evidence)

    def failed(self, mismatch: Mismatch) -> bool:
        """Count a settled mismatch against its odd one; True when that makes it accused."""
        failed = self._failed.get(mismatch.odd)
        if failed is None:
            if len(self._failed) >= MAX_ACCUSED * 4:  # bounded: the oldest unaccused go first
                oldest = min(self._failed, key=lambda n: (n in self.accused, self._failed[n].at))
                del self._failed[oldest]
                self.accused.pop(oldest, None)
            failed = self._failed[mismatch.odd] = _Failed(collections.deque(maxlen=MAX_EVIDENCE))
        failed.checks.appendleft(mismatch.evidence)
        failed.total += 1
        failed.at = world.wall()
        after = self.config.accuse_after
        if after == 0 or mismatch.odd in self.accused or failed.total < after:
            return False
        self.accused[mismatch.odd] = world.wall()
        return True

    def failures(self, node_id: str) -> int:
        """Settled mismatches counted against ``node_id`` (while it is remembered)."""
        failed = self._failed.get(node_id)
        return 0 if failed is None else failed.total

    def record(self) -> AccuserRecord | None:
        """This trainer's accusations entry (None while it accuses nobody)."""
        standing = sorted(self.accused, key=lambda n: self._failed[n].at, reverse=True)[:MAX_ACCUSED]
        if not standing:
            return None
        accusations = tuple(
            Accusation(
                accused=node,
                kind="compute_output",
                rounds=self._failed[node].total,
                at=self._failed[node].at,
                evidence=tuple(self._failed[node].checks),
            )
            for node in standing
        )
        return AccuserRecord(self.node_id, None, accusations, world.wall())
