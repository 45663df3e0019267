"""Where a trainer is in its shards, kept on disk so a restart neither repeats nor skips.

A trainer reads the shards assigned to it (all of them, ``--shard-ranges``, or the operator's
signed assignment: ``agora_trainer.data.rotation``), one shard at a time, in an order drawn from
``data.shuffle_seed`` and the epoch; within a shard, samples come in their own shuffled order
(``shard_progress``). It moves to another shard only at a shard's end, so a new assignment
takes effect at the next shard boundary, never mid-shard. Each open shard's progress (a
watermark plus the positions done above it) and the shards finished this epoch are written
atomically to the state file; a restarted trainer goes on from there and repeats no
completed sample (those in flight when it stopped run again: their updates never completed).

Other trainers of the run are seen through ``others`` (``rotation.OtherTrainers``): a shard
another trainer holds or finished this epoch is not opened here, and one whose holder went
silent is adopted from the progress it last published.

A sample's id is ``epoch * total + first sample of its shard + its index in the shard``: the
same data has the same id within an epoch, whoever reads it.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from agora_core import world
from agora_trainer.data.cursor_journal import COMPACT_EVERY, CompletionJournal
from agora_trainer.data.shard_progress import ShardProgress
from agora_trainer.data.shards import Shard
from agora_trainer.errors import ShardError

STATE_FORMAT = "agora-trainer-cursor-v3"


@dataclass(frozen=True)
class Sample:
    id: int  # epoch * total + the sample's position in the shard set (shard order, unshuffled)
    tokens: np.ndarray  # seq_len + 1 token ids


class Others(Protocol):
    """What this trainer knows of the others' shards (``rotation.OtherTrainers``)."""

    def state(self, epoch: int, shard_id: int) -> tuple[str, Any]:
        """("free" | "finished" | "held" | "unknown", None), or ("stale", the progress its silent
        holder last published)."""
        ...


class NoOthers:
    def state(self, epoch: int, shard_id: int) -> tuple[str, Any]:
        return "free", None


class SampleCursor:
    def __init__(
        self,
        shards: list[Shard],
        seq_len: int,
        state_path: Path | None = None,
        *,
        shuffle_seed: int = 0,
        epochs: int = 1,
        assigned: Iterable[int] | None = None,
        others: Others | None = None,
        clock: Callable[[], float] = lambda: world.wall(),
    ):
        """``assigned``: the shard ids this trainer may open (None: every one)."""
        if epochs < 1:
            raise ValueError("epochs must be >= 1")
        self._shards = shards
        self._seq_len = seq_len
        self._seed = shuffle_seed
        self.epochs = epochs
        self.others: Others = others or NoOthers()
        self._clock = clock
        self._index = {s.entry.id: i for i, s in enumerate(shards)}  # shard id -> position in the set
        self._counts = [s.sample_count(seq_len) for s in shards]
        self._starts = [int(n) for n in np.cumsum([0, *self._counts])]
        self.total = self._starts[-1]  # samples per epoch, over the whole set
        self._state_path = state_path
        self._journal = (
            None
            if state_path is None
            else CompletionJournal(state_path.with_name(f"{state_path.name}.journal"))
        )
        self.epoch = 0
        self.completed = 0  # samples completed here, over every run on this state file
        self._finished: dict[int, set[int]] = {
            0: set()
        }  # epoch -> shard ids finished here (this and the last)
        self._open: dict[tuple[int, int], ShardProgress] = {}  # (epoch, shard id) -> progress
        self._active: ShardProgress | None = None
        self._retry: collections.deque[Sample] = collections.deque()
        self._order_of: tuple[int, list[int]] = (-1, [])  # (epoch, its shard order), computed once
        self._usable_from: dict[int, float] = {}  # shard id -> when a newly assigned shard may open
        self.finished = False  # nothing is left to read, and nothing is in flight
        self.assignment: dict | None = None  # the operator's record obeyed (rotation), kept here
        self.assigned: frozenset[int] = frozenset(self._index)
        self.assign(self._index if assigned is None else assigned)
        if state_path is not None and state_path.exists():
            self._load(state_path)
            for sample_id in self._journal.read():  # completions since the state was written
                self.complete(sample_id, save=False)

    # --- assignment ------------------------------------------------------------------------------

    def assign(self, shard_ids: Iterable[int], *, usable_from: float = 0.0) -> None:
        """From now on open only ``shard_ids``; shards new to this trainer open no sooner than
        ``usable_from`` (a time: the trainer they come from stops opening them as soon as it
        reads the same assignment, and publishes what it holds, before then). A shard open
        now is read to its end."""
        ids = frozenset(shard_ids)
        unknown = sorted(ids - self._index.keys())
        if unknown:
            raise ShardError(
                f"shards {unknown[:8]} are not in this shard set (its ids: 0..{len(self._shards) - 1})"
            )
        for shard_id in ids - self.assigned:
            self._usable_from[shard_id] = usable_from
        self.assigned = ids
        self.finished = False

    # --- state file ------------------------------------------------------------------------------

    def _identity(self) -> list[list[Any]]:
        """The shards by id, name and digest: a shard remade under the same name is another shard."""
        return [[s.entry.id, s.name, s.entry.blake2b] for s in self._shards]

    def _load(self, path: Path) -> None:
        state = json.loads(path.read_text())
        if state.get("format") != STATE_FORMAT or state.get("shards") != self._identity():
            raise ShardError(f"{path} belongs to another set of shards; move it away to start over")
        for key, mine in (("seq_len", self._seq_len), ("shuffle_seed", self._seed)):
            if state.get(key) != mine:
                raise ShardError(f"{path} was written for {key} {state.get(key)}, the run uses {mine}")
        self.epoch = int(state["epoch"])
        self.completed = int(state["completed"])
        self.assignment = state.get("assignment")
        self._finished = {int(e): {int(i) for i in ids} for e, ids in state["finished"].items()}
        self._finished.setdefault(self.epoch, set())
        for value in state["open"]:
            progress = self._progress(value)
            self._open[(progress.epoch, progress.shard_id)] = progress

    def _progress(self, value: Any) -> ShardProgress:
        shard_id = int(value["shard"]) if isinstance(value, dict) and "shard" in value else -1
        if shard_id not in self._index:
            raise ShardError(f"shard progress for an unknown shard: {str(value)[:80]}")
        return ShardProgress.from_value(
            value, count=self._counts[self._index[shard_id]], shuffle_seed=self._seed
        )

    def save(self) -> None:
        """Write the state atomically (a crash leaves the previous state, never a torn one)."""
        if self._state_path is None:
            return
        state = {
            "format": STATE_FORMAT,
            "shards": self._identity(),
            "seq_len": self._seq_len,
            "shuffle_seed": self._seed,
            "epoch": self.epoch,
            "completed": self.completed,
            "finished": {str(e): sorted(ids) for e, ids in self._finished.items()},
            "open": [p.to_value() for p in self._open.values()],
            "assignment": self.assignment,
        }
        tmp = self._state_path.with_name(f".{self._state_path.name}.partial")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, self._state_path)
        self._journal.clear()

    def close(self) -> None:
        """Write the state (and empty the journal); the cursor can go on after."""
        self.save()
        if self._journal is not None:
            self._journal.close()

    # --- what is published to the other trainers -------------------------------------------------

    @property
    def done(self) -> int:
        return self.completed

    def holding(self) -> list[ShardProgress]:
        """The shards open here (being read, or with samples in flight)."""
        return list(self._open.values())

    def finished_in(self, epoch: int) -> list[int]:
        return sorted(self._finished.get(epoch, ()))

    def yield_shard(self, epoch: int, shard_id: int) -> bool:
        """Another trainer took over this open shard (it adopted it while this one was silent):
        stop reading it here. Its samples in flight here complete into nothing."""
        progress = self._open.pop((epoch, shard_id), None)
        if progress is None:
            return False
        if self._active is progress:
            self._active = None
        self._retry = collections.deque(s for s in self._retry if self.locate(s.id)[:2] != (epoch, shard_id))
        self.save()
        return True

    # --- samples ---------------------------------------------------------------------------------

    def locate(self, sample_id: int) -> tuple[int, int, int]:
        """(epoch, shard id, index in the shard) of a sample id."""
        epoch, rest = divmod(sample_id, max(self.total, 1))
        position = bisect.bisect_right(self._starts, rest) - 1  # plain ints: no numpy call per sample
        return epoch, self._shards[position].entry.id, rest - self._starts[position]

    def _sample_id(self, progress: ShardProgress, index: int) -> int:
        return progress.epoch * self.total + self._starts[self._index[progress.shard_id]] + index

    def _sample(self, progress: ShardProgress, index: int) -> Sample:
        shard = self._shards[self._index[progress.shard_id]]
        return Sample(self._sample_id(progress, index), shard.sample(index, self._seq_len))

    def _order(self) -> list[int]:
        """The shard ids in the order this epoch opens them."""
        if self._order_of[0] != self.epoch:
            ids = sorted(self._index)
            order = np.random.default_rng([self._seed, self.epoch]).permutation(len(ids))
            self._order_of = (self.epoch, [ids[i] for i in order])
        return self._order_of[1]

    def _next_shard(self) -> tuple[ShardProgress | None, bool]:
        """A shard to read next (open already, or newly opened), or (None, whether one is
        waiting for its handover)."""
        for progress in sorted(self._open.values(), key=lambda p: p.epoch):  # resume what is mine first
            if progress.take_would_give():
                return progress, False
        now, waiting, done = self._clock(), False, self._finished[self.epoch]
        for shard_id in self._order():
            if shard_id not in self.assigned or shard_id in done or (self.epoch, shard_id) in self._open:
                continue
            if self._usable_from.get(shard_id, 0.0) > now:
                waiting = True
                continue
            state, published = self.others.state(self.epoch, shard_id)
            if state == "finished":
                continue
            if state in ("held", "unknown"):
                # Another trainer reads it (it may finish it, or go silent and leave it to be
                # adopted), or the others' claims of this epoch are not read yet: wait for it.
                waiting = True
                continue
            if state == "stale":  # its holder went silent: go on where it stopped
                progress = self._progress(published)
                progress.since = now
            else:
                count = self._counts[self._index[shard_id]]
                progress = ShardProgress(
                    shard_id=shard_id, epoch=self.epoch, count=count, shuffle_seed=self._seed, since=now
                )
            if progress.finished:
                done.add(shard_id)
                continue
            self._open[(self.epoch, shard_id)] = progress
            self.save()  # the journal's completions in it need it in the state
            return progress, False
        return None, waiting

    def take(self) -> Sample | None:
        """The next sample to run: one handed back first, else the next of the shard being
        read, else the first of the next shard. None when there is nothing to take now;
        ``finished`` then says whether anything ever will be (else wait and ask again)."""
        if self._retry:
            return self._retry.popleft()
        while True:
            if self._active is not None:
                index = self._active.take()
                if index is not None:
                    return self._sample(self._active, index)
                self._active = None
            progress, waiting = self._next_shard()
            if progress is not None:
                self._active = progress
                continue
            if self._open or waiting:
                return None  # samples in flight (they may come back), or a shard on its way here
            if self.epoch + 1 >= self.epochs:
                self.finished = True
                return None
            self.epoch += 1
            self._finished = {self.epoch - 1: self._finished[self.epoch - 1], self.epoch: set()}
            self.save()

    def outstanding(self) -> list[int]:
        """Ids taken and not completed: in flight, or handed back to run again. A crash now
        leaves them to the restart (its state file has them not done)."""
        ids = [s.id for s in self._retry]  # handed back: taken and not done in its shard too
        for progress in self._open.values():
            for position in progress.taken_not_done():
                ids.append(self._sample_id(progress, int(progress.order[position])))
        return list(dict.fromkeys(ids))

    def holds(self, sample_id: int) -> bool:
        """Whether ``sample_id`` is still to run here: its shard is open here and the sample
        not completed."""
        epoch, shard_id, index = self.locate(sample_id)
        progress = self._open.get((epoch, shard_id))
        return progress is not None and not progress.is_done(index)

    def give_back(self, sample: Sample) -> None:
        """A sample that could not be completed now: it is taken again before new ones."""
        self._retry.append(sample)

    def complete(self, sample_id: int, *, save: bool = True) -> None:
        """Mark a sample done; ``save``: on disk before this returns (journaled, or the state
        rewritten when a shard finishes or the journal is long)."""
        epoch, shard_id, index = self.locate(sample_id)
        progress = self._open.get((epoch, shard_id))
        if progress is None:
            return  # its shard was yielded to another trainer
        progress.complete(index)
        self.completed += 1
        finished = progress.finished
        if finished:
            del self._open[(epoch, shard_id)]
            if epoch in self._finished:
                self._finished[epoch].add(shard_id)
            if self._active is progress:
                self._active = None
        if not save or self._journal is None:
            return
        if finished or self._journal.entries >= COMPACT_EVERY:
            self.save()
        else:
            self._journal.append(sample_id)


def reading_order(
    shards: list[Shard], seq_len: int, shuffle_seed: int, count: int | None = None
) -> list[int]:
    """The ids of the first ``count`` samples (all: None) a lone trainer reading every one of
    ``shards`` takes, in its order: what its loss log should hold, for tests and benchmarks."""
    cursor = SampleCursor(shards, seq_len, shuffle_seed=shuffle_seed)
    order: list[int] = []
    while (count is None or len(order) < count) and (sample := cursor.take()) is not None:
        order.append(sample.id)
        cursor.complete(sample.id, save=False)
    return order
