"""One shard's samples in one epoch: their shuffled order, and which of them are done.

A shard's samples are read in an order drawn from ``data.shuffle_seed``, the epoch and the
shard's stable id (the manifest's), so every trainer that ever reads the shard in that epoch
reads it in the same order, and a trainer handed a half-read shard goes on where its holder
stopped. Progress is kept as positions in that order: a watermark (every position below it is
done) plus the done positions above it, since lanes finish samples out of order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from agora_trainer.errors import ShardError


def sample_order(shuffle_seed: int, epoch: int, shard_id: int, count: int) -> np.ndarray:
    """The sample indices of a shard of ``count`` samples, in the order they are read."""
    return np.random.default_rng([shuffle_seed, epoch, shard_id]).permutation(count)


class ShardProgress:
    def __init__(
        self,
        *,
        shard_id: int,
        epoch: int,
        count: int,
        shuffle_seed: int,
        watermark: int = 0,
        done_above: Iterable[int] = (),
        since: float = 0.0,
    ):
        """``since``: when its reader opened (or adopted) it; of two trainers reading one
        shard, the later one keeps it."""
        self.shard_id, self.epoch, self.count = shard_id, epoch, count
        self.order = sample_order(shuffle_seed, epoch, shard_id, count)
        self._position = np.empty(count, dtype=np.int64)
        self._position[self.order] = np.arange(count)
        self.watermark = watermark
        self.done_above = set(done_above)
        self.since = since
        if not 0 <= watermark <= count or any(not watermark < p < count for p in self.done_above):
            raise ShardError(
                f"shard {shard_id}: progress {watermark} / {sorted(self.done_above)[:4]} is not in 0..{count}"
            )
        self._next = watermark  # the next position to hand out

    @property
    def done(self) -> int:
        return self.watermark + len(self.done_above)

    @property
    def finished(self) -> bool:
        return self.watermark >= self.count

    def take_would_give(self) -> bool:
        """Whether ``take`` has a sample to hand out (some position neither done nor taken)."""
        self._next = max(self._next, self.watermark)
        while self._next < self.count and self._next in self.done_above:
            self._next += 1
        return self._next < self.count

    def take(self) -> int | None:
        """The sample index at the next position not done and not handed out, or None."""
        if not self.take_would_give():
            return None
        index = int(self.order[self._next])
        self._next += 1
        return index

    def is_done(self, index: int) -> bool:
        position = int(self._position[index])
        return position < self.watermark or position in self.done_above

    def taken_not_done(self) -> list[int]:
        """Positions handed out and not done (in flight)."""
        return [p for p in range(self.watermark, self._next) if p not in self.done_above]

    def complete(self, index: int) -> None:
        position = int(self._position[index])
        if position < self.watermark:
            return  # already done (a sample completed twice is counted once)
        self.done_above.add(position)
        while self.watermark in self.done_above:
            self.done_above.discard(self.watermark)
            self.watermark += 1

    # --- persistence and the DHT claim ------------------------------------------------------------

    def to_value(self) -> dict[str, Any]:
        return {
            "shard": self.shard_id,
            "epoch": self.epoch,
            "watermark": self.watermark,
            "done_above": sorted(self.done_above),
            "since": self.since,
        }

    @classmethod
    def from_value(cls, value: Any, *, count: int, shuffle_seed: int) -> ShardProgress:
        """A shard's progress as saved (or as another trainer published it); ShardError if malformed."""
        try:
            return cls(
                shard_id=int(value["shard"]),
                epoch=int(value["epoch"]),
                count=count,
                shuffle_seed=shuffle_seed,
                watermark=int(value["watermark"]),
                done_above=[int(p) for p in value["done_above"]],
                since=float(value.get("since", 0.0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"a shard progress record is malformed ({exc!r})") from None
