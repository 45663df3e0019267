"""Where a trainer is in its shards, kept on disk so a restart neither repeats nor skips.

Samples are numbered across the trainer's shards in order. Lanes finish samples out of order,
so the state is a watermark (every sample below it is done) plus the done samples above it.
A restarted trainer starts again at the watermark and skips those already done; samples that
were in flight when it stopped are done again, since their updates never completed.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agora_trainer.shards import Shard

STATE_FORMAT = "agora-trainer-cursor-v2"


@dataclass(frozen=True)
class Sample:
    id: int  # position in the trainer's sequence of samples
    tokens: np.ndarray  # seq_len + 1 token ids


class SampleCursor:
    def __init__(self, shards: list[Shard], seq_len: int, state_path: Path | None = None):
        self._shards = shards
        self._seq_len = seq_len
        self._starts = [int(n) for n in np.cumsum([0] + [s.sample_count(seq_len) for s in shards])]
        self.total = self._starts[-1]
        self._state_path = state_path
        self.watermark = 0
        self._done_above: set[int] = set()
        self._next = 0
        self._retry: collections.deque[Sample] = collections.deque()
        self._unsaved = 0
        if state_path is not None and state_path.exists():
            self._load(state_path)

    def _load(self, path: Path) -> None:
        state = json.loads(path.read_text())
        if state.get("format") != STATE_FORMAT or state.get("shards") != self._identity():
            raise ValueError(f"{path} belongs to another set of shards; move it away to start over")
        if state.get("seq_len") != self._seq_len:
            raise ValueError(
                f"{path} was written for seq_len {state.get('seq_len')}, the run uses {self._seq_len}"
            )
        self.watermark = int(state["watermark"])
        self._done_above = {int(i) for i in state["done_above"]}
        self._next = self.watermark

    def _identity(self) -> list[list[str]]:
        """The shards by name and digest: a shard remade under the same name is another shard."""
        return [[s.name, s.entry.blake2b] for s in self._shards]

    def save(self) -> None:
        """Write the state atomically (a crash leaves the previous state, never a torn one)."""
        if self._state_path is None:
            return
        state = {
            "format": STATE_FORMAT,
            "shards": self._identity(),
            "seq_len": self._seq_len,
            "watermark": self.watermark,
            "done_above": sorted(self._done_above),
        }
        tmp = self._state_path.with_name(f".{self._state_path.name}.partial")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._state_path)
        self._unsaved = 0

    @property
    def done(self) -> int:
        return self.watermark + len(self._done_above)

    @property
    def exhausted(self) -> bool:
        return self.done >= self.total

    def _load_sample(self, sample_id: int) -> Sample:
        shard = bisect.bisect_right(self._starts, sample_id) - 1  # plain ints: no numpy call per sample
        index = sample_id - self._starts[shard]
        return Sample(sample_id, self._shards[shard].sample(index, self._seq_len))

    def take(self) -> Sample | None:
        """The next sample to run: one handed back first, else the next not yet done."""
        if self._retry:
            return self._retry.popleft()
        # Skip what is done: below the watermark, or done above it (before a restart).
        self._next = max(self._next, self.watermark)
        while self._next < self.total and self._next in self._done_above:
            self._next += 1
        if self._next >= self.total:
            return None
        sample = self._load_sample(self._next)
        self._next += 1
        return sample

    def give_back(self, sample: Sample) -> None:
        """A sample that could not be completed now: it is taken again before new ones."""
        self._retry.append(sample)

    def complete(self, sample_id: int, *, save_every: int = 64) -> None:
        self._done_above.add(sample_id)
        while self.watermark in self._done_above:
            self._done_above.discard(self.watermark)
            self.watermark += 1
        self._unsaved += 1
        if self._unsaved >= save_every:
            self.save()
