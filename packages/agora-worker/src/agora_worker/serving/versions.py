"""Weight versions: the weights a sample's forward used, kept until its backward.

A worker keeps nothing per request, so a backward recomputes the stage's forward. Between a
sample's forward and its backward the stage may have stepped (other samples completed a
batch) or averaged; recomputing under the new weights gives gradients of a forward nobody ran,
against an output gradient the later stages computed for the old one.

So each forward's reply names its weights' version, a trainer sends that name back with the
backward, and the backward recomputes under those weights when they are still kept: the last
``keep`` versions that served a forward, each a copy of the stage's trained parameters made
when it served its first forward. What goes is the mismatch, not the delay of a pipelined
run: such a gradient still belongs to an earlier step's weights (benchmarks/convergence.py
measures both: the delay costs far more), and ``using`` says so, for the backend to apply its
run's ``optimizer.stale_gradients`` policy. A version that aged out, or a name this worker
never gave (another worker's, or from before a restart: names carry a random prefix per
process), recomputes under the live weights, as before, and is counted. Backwards batch by
the weights they recompute under (``weights_of_each``), not by name: every name that resolves to
the live weights shares a batch with every other, so a step with samples in flight does not
split the backward queue into one batch per name.

A version changes whenever any trained parameter was written in place (a step, an averaging
round's delta, a state install): torch counts in-place writes per tensor (``_version``), so
every path that changes weights is seen without each having to say so. Everything here runs on
the compute thread.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator, Sequence

import torch

from agora_core import world

# Names of versions whose step is remembered (to measure staleness) without their weights.
REMEMBERED_VERSIONS = 256
NAME_BITS = 32  # the counter's bits; a random prefix per process sits above them
LIVE = 0  # weights_of_each: the live weights (no version is ever named 0)


class WeightVersions:
    """Versions of ``params`` (the stage's trained compute tensors, written in place only)."""

    def __init__(self, params: Sequence[torch.Tensor], *, keep: int):
        """``keep``: weight copies kept for backwards (0: every backward uses the live weights;
        versions are still named and staleness still measured)."""
        if keep < 0:
            raise ValueError("keep must be >= 0")
        self._params = list(params)
        self.keep = keep
        self._prefix = world.rng().getrandbits(20) << NAME_BITS  # a simulation's replays alike
        self._counter = 0
        self._fingerprint: tuple[int, ...] | None = None
        self._kept: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._steps: collections.OrderedDict[int, int] = collections.OrderedDict()  # name -> step
        self.current = 0  # the name of the live weights' version (0: none served yet)
        # backwards, by how they ran: under their forward's kept weights, the live ones (their
        # version still live), or the live ones because their version was gone or unknown
        self.kept_samples = 0
        self.live_samples = 0
        self.missed_samples = 0
        self._staleness: list[tuple[int, int]] = []  # (steps behind, samples) since last taken

    def _written(self) -> tuple[int, ...]:
        return tuple(p._version for p in self._params)

    def mark(self, step: int) -> int:
        """The name of the live weights, for a forward about to run under them at optimizer
        step ``step``; the first forward of a new version keeps a copy of its weights."""
        written = self._written()
        if written != self._fingerprint or not self.current:
            self._fingerprint = written
            self._counter = (self._counter + 1) % (1 << NAME_BITS) or 1
            self.current = self._prefix | self._counter
            self._steps[self.current] = step
            while len(self._steps) > REMEMBERED_VERSIONS:
                self._steps.popitem(last=False)
            if self.keep:
                with torch.no_grad():
                    self._kept[self.current] = [p.detach().clone() for p in self._params]
                while len(self._kept) > self.keep:
                    self._kept.popitem(last=False)
        return self.current

    def _live_name(self) -> int | None:
        """The live weights' version name, None once they were written since it was marked."""
        return self.current if self._written() == self._fingerprint else None

    def weights_of_each(self, names: Sequence[int | None]) -> list[int]:
        """The weights a backward of each name's forward recomputes under, as of now: that
        name while its copy is kept and it is not the live version, else ``LIVE``. Backwards
        of one answer may share a batch, whatever their names."""
        live = self._live_name()
        return [LIVE if name is None or name not in self._kept or name == live else name for name in names]

    @contextlib.contextmanager
    def using(self, names: Sequence[int | None], *, step: int) -> Iterator[bool]:
        """Run a backward of ``len(names)`` samples, each named by its forward's version, at
        optimizer step ``step``, under their weights (one answer of ``weights_of_each`` for all:
        ValueError otherwise): a kept copy swapped in for the block and swapped back after,
        even on failure, or the live weights. Yields whether those are the weights of an
        earlier step than ``step``: the batch's gradient is stale."""
        counts = collections.Counter(names)
        live = self._live_name()  # read once: the fingerprint covers every trained parameter
        answers = set(self.weights_of_each(list(counts)))
        if len(answers) > 1:
            raise ValueError("a backward batch mixes samples of different weights")
        weights = answers.pop() if answers else LIVE
        for name, samples in counts.items():
            forward_step = self._steps.get(name) if name is not None else None
            if forward_step is not None:
                self._staleness.append((max(0, step - forward_step), samples))
            if weights != LIVE:
                self.kept_samples += samples
            elif name is not None and name == live:
                self.live_samples += samples
            else:
                self.missed_samples += samples
        if weights == LIVE:
            yield False
            return
        held = [p.data for p in self._params]
        try:
            for p, copy in zip(self._params, self._kept[weights], strict=True):
                p.data = copy  # the tensor stays the optimizer's; only its storage is swapped
            yield self._steps.get(weights, step) < step
        finally:
            for p, data in zip(self._params, held, strict=True):
                p.data = data

    def take_staleness(self) -> list[tuple[int, int]]:
        """(steps between forward and backward, samples) of the backwards since the last call."""
        taken, self._staleness = self._staleness, []
        return taken
