"""From clipped contributions to accusations: which peers this worker accuses, and why.

One clip is not an accusation: honest drift has tails, and a peer whose first visits had no
history may stand far off once. A peer is accused when it was clipped in
``accuse_after_rounds`` of the last ``accuse_window_rounds`` rounds this worker ran, and from
then on for as long as this worker runs (an accusation stands; the authorizer pardons). A
declared weight counts only past what no honest peer can declare (``weight_limit``: many
rounds of the whole stage's samples), since an honest fast peer may outweigh a slow reducer
several times over. The accusations go to the DHT (:mod:`agora_core.admission.accusations`)
with the worst evidence of the newest rounds; the authorizer decides what follows.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from agora_core import world
from agora_core.admission.accusations import MAX_ACCUSED, MAX_EVIDENCE, Accusation, AccuserRecord, Evidence
from agora_worker.averaging.robust import Clipped

FLOAT32_MAX = 3.4028234663852886e38
KIND_OF_ROLE = {"sender": "averaging_values", "reducer": "averaging_reducer", "weight": "averaging_weight"}


@dataclass
class _Seen:
    """What this worker saw one peer do wrong of one kind: the rounds, the worst per round."""

    keep: int  # rounds whose evidence is kept: the newest
    rounds: dict[int, Evidence] = field(default_factory=dict)  # round -> its worst evidence
    total: int = 0  # distinct rounds seen, kept or not
    at: float = 0.0  # wall-clock seconds of the newest round

    def add(self, clipped: Clipped) -> None:
        measured, radius = (_finite(v) for v in (clipped.rms, clipped.radius))
        evidence = Evidence(clipped.round, clipped.slice, max(clipped.chunk, -1), measured, radius)
        kept = self.rounds.get(clipped.round)
        if kept is None:
            self.total += 1
        if kept is None or _excess(evidence) > _excess(kept):
            self.rounds[clipped.round] = evidence
        if len(self.rounds) > self.keep:
            del self.rounds[min(self.rounds)]
        self.at = world.wall()


def _finite(value: float) -> float:
    """A distance for the record: a non-finite one (NaN or infinite values sent) as the
    largest float32, which every reader can hold and compare."""
    return value if math.isfinite(value) else FLOAT32_MAX


def _excess(evidence: Evidence) -> float:
    return evidence.measured / evidence.radius if evidence.radius > 0 else float("inf")


class Accuser:
    def __init__(
        self, *, node_id: str, stage: int, after_rounds: int, window_rounds: int, weight_limit: float
    ):
        """``after_rounds`` 0: never accuse."""
        self.node_id, self.stage = node_id, stage
        self.after_rounds, self.window_rounds = after_rounds, window_rounds
        self.weight_limit = weight_limit
        self._recent: collections.deque[int] = collections.deque(maxlen=max(1, window_rounds))  # rounds run
        self._seen: dict[tuple[str, str], _Seen] = {}  # (peer, kind) -> what it did
        self.accused: dict[tuple[str, str], float] = {}  # (peer, kind) -> when first accused

    def observe(self, round_index: int, evidence: list[Clipped]) -> list[tuple[str, str]]:
        """A round this worker ran, with what it clipped in it; returns the (peer, kind) pairs
        newly accused."""
        self._recent.append(round_index)
        for clipped in evidence:
            if clipped.peer == self.node_id or clipped.role not in KIND_OF_ROLE:
                continue
            if clipped.role == "weight" and clipped.rms <= self.weight_limit:
                continue
            pair = (clipped.peer, KIND_OF_ROLE[clipped.role])
            self._seen.setdefault(pair, _Seen(keep=max(MAX_EVIDENCE, self.window_rounds))).add(clipped)
        if self.after_rounds <= 0:
            return []
        window = set(self._recent)
        newly = []
        for pair, seen in self._seen.items():
            if pair not in self.accused and len(window.intersection(seen.rounds)) >= self.after_rounds:
                self.accused[pair] = world.wall()
                newly.append(pair)
        self._forget(window)
        return newly

    def _forget(self, window: set[int]) -> None:
        """Drop what an unaccused peer did before the window: it can no longer add up."""
        for pair in [p for p in self._seen if p not in self.accused]:
            seen = self._seen[pair]
            seen.rounds = {r: e for r, e in seen.rounds.items() if r in window}
            seen.total = len(seen.rounds)
            if not seen.rounds:
                del self._seen[pair]

    def accusations(self) -> list[Accusation]:
        """The standing accusations, newest first, at most what one DHT entry holds."""
        standing = sorted(self.accused, key=lambda pair: self._seen[pair].at, reverse=True)[:MAX_ACCUSED]
        out = []
        for peer, kind in standing:
            seen = self._seen[(peer, kind)]
            newest = sorted(seen.rounds.values(), key=lambda e: e.round, reverse=True)[:MAX_EVIDENCE]
            out.append(
                Accusation(accused=peer, kind=kind, rounds=seen.total, at=seen.at, evidence=tuple(newest))
            )
        return out

    def record(self) -> AccuserRecord | None:
        """This worker's DHT entry (None while it accuses nobody)."""
        accusations = self.accusations()
        if not accusations:
            return None
        return AccuserRecord(self.node_id, self.stage, tuple(accusations), world.wall())

    def info(self) -> dict:
        """peer -> kinds it stands accused of here (for worker.info)."""
        accused: dict[str, list[str]] = {}
        for peer, kind in sorted(self.accused):
            accused.setdefault(peer, []).append(kind)
        return accused
