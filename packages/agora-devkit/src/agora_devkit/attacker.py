"""A worker that lies in its averaging rounds, for the attacker tests and benchmarks.

``python -m agora_devkit.attacker ATTACK[@ROUND|@+N] [agora-worker arguments...]`` runs
``agora-worker`` with one lie patched into its averaging (from the stage's round ROUND on, or
after it took part in N rounds: a peer that turns after its replicas know it, or after its
probation) and nothing else changed: it serves, trains, joins and announces honestly. The
lies:

- ``scaled``: every value it sends (and the centre of every slice it reduces) times 3;
- ``sign_flip``: its values negated;
- ``noise``: its values plus Gaussian noise of the values' own RMS;
- ``push``: its values plus a small fixed step (``PUSH_PER_VALUE``) in one direction, every
  round: too small for clipping to tell from drift;
- ``weight``: honest values under a declared weight of ``INFLATED_WEIGHT`` samples;
- ``progress``: its stage-progress reports and pushes claim ``CLAIMED_LEAD`` steps more than
  it took (ROUND does not apply: it lies from the start).

agora-devkit is never a dependency of a role: no installed worker can run this.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import numpy as np

INFLATED_WEIGHT = 1e9
CLAIMED_LEAD = 1000
PUSH_PER_VALUE = 1e-3
SCALE = 3.0


def _noise(values: np.ndarray) -> np.ndarray:
    rms = float(np.sqrt(np.mean(values.astype(np.float64) ** 2))) if len(values) else 0.0
    rng = np.random.default_rng()
    return values + rng.normal(0.0, rms or 1.0, len(values)).astype(np.float32)


VALUE_LIES: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "scaled": lambda values: values * np.float32(SCALE),
    "sign_flip": lambda values: -values,
    "noise": _noise,
    "push": lambda values: values + np.float32(PUSH_PER_VALUE),
}
ATTACKS = (*VALUE_LIES, "weight", "progress")


def _claim_ahead() -> None:
    """Stage progress that claims ``CLAIMED_LEAD`` more steps, in the signed report and in
    every push; the worker's own decisions still see its true step."""
    from agora_core.schema import StageProgress
    from agora_worker.progress import tracker

    class ReportsAhead:  # what the tracker builds its own reports with
        from_value = staticmethod(StageProgress.from_value)

        def __call__(self, *, step: int, **fields) -> StageProgress:
            return StageProgress(step=step + CLAIMED_LEAD, **fields)

    quiet_poke = tracker.StageProgressTracker._quiet_poke

    async def poke_ahead(self, address: str, step: int, samples: int) -> None:
        await quiet_poke(self, address, step + CLAIMED_LEAD, samples)

    tracker.StageProgress = ReportsAhead()
    tracker.StageProgressTracker._quiet_poke = poke_ahead


class Turning:
    """When the lie starts: at the stage's round ``from_round``, or (``relative``) after this
    worker took part in ``from_round`` rounds (a joiner that passes its probation first)."""

    def __init__(self, from_round: int, *, relative: bool = False):
        self.from_round, self.relative = from_round, relative
        self.seen: set[int] = set()

    def lying(self, round_index: int) -> bool:
        if not self.relative:
            return round_index >= self.from_round
        self.seen.add(round_index)
        return len(self.seen) > self.from_round


def patch(attack: str, from_round: int = 0, *, relative: bool = False) -> None:
    """Patch ``attack`` into this process's averaging (before the worker starts), for rounds
    ``from_round`` on (``relative``: after it took part in that many)."""
    from agora_worker.averaging import allreduce, matchmaking

    turning = Turning(from_round, relative=relative)
    if attack in VALUE_LIES:
        lie, honest = VALUE_LIES[attack], allreduce.contribute

        async def contribute(*, values: np.ndarray, group, **kwargs):
            if turning.lying(group.round):
                values = lie(np.asarray(values, np.float32))
            return await honest(values=values, group=group, **kwargs)

        allreduce.contribute = contribute
    elif attack == "weight":
        form_group = matchmaking.Matchmaker.form_group

        async def inflated(self, round_index, me, **kwargs):
            if turning.lying(round_index):
                me = dataclasses.replace(me, weight=INFLATED_WEIGHT)
            return await form_group(self, round_index, me, **kwargs)

        matchmaking.Matchmaker.form_group = inflated
    elif attack == "progress":
        _claim_ahead()
    else:
        raise SystemExit(f"unknown attack {attack!r}: one of {', '.join(ATTACKS)}")


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    attack, _, from_round = args[0].partition("@")
    patch(attack, int(from_round or 0), relative=from_round.startswith("+"))
    from agora_worker.cli import main as worker_main

    worker_main(args[1:], prog_name="agora-worker")


if __name__ == "__main__":
    main()
