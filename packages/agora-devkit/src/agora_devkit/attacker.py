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

Lies in what it computes for trainers (``@+N``: after it served N forward requests honestly;
ROUND alone does not apply), while it trains and averages honestly:

- ``garbage``: outputs (boundaries, losses, the input gradients a backward returns) replaced
  by random values of their own RMS;
- ``zeros``: outputs replaced by zeros;
- ``stale``: forwards (and the tail's losses) computed with the weights it held when it
  turned, never updated since.

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
COMPUTE_LIES = ("garbage", "zeros", "stale")
ATTACKS = (*VALUE_LIES, "weight", "progress", *COMPUTE_LIES)


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


def _computes_wrongly(attack: str, after_forwards: int) -> None:
    """Patch the stage backend's served outputs with ``attack`` once it served
    ``after_forwards`` forward requests (training, its own gradients, stays honest)."""
    import copy

    import torch

    from agora_worker.serving import backend

    served = [0]
    frozen: dict = {}  # "module": the stage as it was when the lie began (stale)
    rng = torch.Generator().manual_seed(0)

    def lying(self) -> bool:
        if served[0] < after_forwards:
            return False
        if attack == "stale" and "module" not in frozen:
            frozen["module"] = copy.deepcopy(self.module)
        return True

    def wrong(value: torch.Tensor) -> torch.Tensor:
        if attack == "zeros":
            return torch.zeros_like(value)
        rms = float(value.float().pow(2).mean().sqrt()) or 1.0
        noise = torch.randn(value.shape, generator=rng) * rms
        return noise.abs().to(value.dtype) if value.dim() == 1 else noise.to(value.dtype)  # losses stay >= 0

    def stale(self, method, *args):
        # one compute thread calls the backend: swapping its module for a call is safe
        kept, self.module = self.module, frozen["module"]
        try:
            return method(self, *args)
        finally:
            self.module = kept

    honest_forward, honest_evaluate = backend.StageBackend.forward, backend.StageBackend.evaluate
    honest_fb, honest_backward = backend.StageBackend.forward_backward, backend.StageBackend.backward

    def forward(self, tokens, boundary):
        served[0] += 1
        if not lying(self):
            return honest_forward(self, tokens, boundary)
        if attack == "stale":
            return stale(self, honest_forward, tokens, boundary)
        return wrong(honest_forward(self, tokens, boundary))

    def evaluate(self, tokens, boundary, labels):
        served[0] += 1
        if not lying(self):
            return honest_evaluate(self, tokens, boundary, labels)
        if attack == "stale":
            return stale(self, honest_evaluate, tokens, boundary, labels)
        return wrong(honest_evaluate(self, tokens, boundary, labels))

    def forward_backward(self, tokens, boundary, labels):
        served[0] += 1
        losses, grad = honest_fb(self, tokens, boundary, labels)
        if not lying(self):
            return losses, grad
        if attack == "stale":
            return stale(self, honest_evaluate, tokens, boundary, labels), grad
        return wrong(losses), wrong(grad)

    def backward(self, tokens, boundary, grad, *, versions=None):
        found = honest_backward(
            self, tokens, boundary, grad, versions=versions
        )  # its own training stays honest
        if found is None or served[0] < after_forwards or attack == "stale":
            return found
        return wrong(found)

    backend.StageBackend.backward = backward
    backend.StageBackend.forward = forward
    backend.StageBackend.evaluate = evaluate
    backend.StageBackend.forward_backward = forward_backward


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
    elif attack in COMPUTE_LIES:
        _computes_wrongly(attack, from_round if relative else 0)
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
