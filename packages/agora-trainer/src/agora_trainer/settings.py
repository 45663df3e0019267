"""What a trainer is told on its command line (and tests in code): lanes, limits, intervals, shards."""

from __future__ import annotations

from dataclasses import dataclass

from agora_core.config import require
from agora_trainer.data.rotation_record import parse_ranges
from agora_trainer.spotcheck import CHECK_FRACTION
from agora_trainer.witness import DISTRUST_S, OUTLIER_RATIO


@dataclass(kw_only=True, frozen=True)
class TrainerSettings:
    lanes: int = 8  # microbatches in flight at once (each lane is one of the paper's trainers)
    # Samples a lane carries through the pipeline together: one request per hop for all of
    # them, so the per-message cost (encode, send, decode, queue, wake-up) is paid once for the
    # lot, and each worker computes them as one batch even where few lanes meet in its queue.
    microbatch: int = 1
    max_samples: int | None = None  # stop after completing this many (None: run the shards out)
    refresh_interval_s: float = 5.0  # how often worker lists are re-read from the DHT
    ban_s: float = 10.0  # a worker whose call failed is skipped this long
    # How often progress is published to the DHT; at most dht.record_ttl_s / 3 (its lifetime).
    progress_interval_s: float = 2.0
    max_attempts: int = 5  # per stage call, across the stage's workers
    wait_for_worker_s: float = 120.0  # how long a stage may have no usable worker, at start and per call
    max_requeues: int = 3  # a sample that keeps failing is abandoned (loudly) after this
    state_file: str | None = None  # where the shard position is kept (default: in --shards)
    shard_ranges: str | None = (
        None  # the shard ids this trainer reads ("0-3,8"; None: all), until an operator assigns others
    )
    epochs: int = 1  # passes over its shards (each in a new shuffled order)
    shard_adopt_after_s: float = 30.0  # a shard whose holder published nothing this long is adopted
    loss_log: str | None = None  # JSON lines file: one {"id", "loss", "t"} per completed sample
    backward_routing: str = "pinned"  # "random": backward to any replica (ablation only)
    # A worker whose samples' mean loss exceeds this x its stage peers' over the same period
    # is a loss outlier (agora_trainer.witness) and gets no new microbatch for distrust_s.
    loss_outlier_ratio: float = OUTLIER_RATIO
    distrust_s: float = DISTRUST_S
    # Of the microbatches, the fraction whose output at each stage is asked again of another
    # replica (agora_trainer.spotcheck); a worker caught twice is accused. 0: no checks.
    spot_check_fraction: float = CHECK_FRACTION

    def __post_init__(self) -> None:
        require(self.lanes >= 1, "lanes", "must be >= 1")
        require(self.microbatch >= 1, "microbatch", "must be >= 1")
        require(self.max_samples is None or self.max_samples >= 1, "max_samples", "must be >= 1")
        for name in ("refresh_interval_s", "ban_s", "progress_interval_s", "wait_for_worker_s", "distrust_s"):
            require(getattr(self, name) > 0, name, "must be positive")
        require(self.max_attempts >= 1, "max_attempts", "must be >= 1")
        require(self.backward_routing in ("pinned", "random"), "backward_routing", "must be pinned or random")
        require(self.loss_outlier_ratio > 1.0, "loss_outlier_ratio", "must be > 1")
        require(0.0 <= self.spot_check_fraction <= 1.0, "spot_check_fraction", "must lie in [0, 1]")
        require(self.max_requeues >= 0, "max_requeues", "must be >= 0")
        require(self.epochs >= 1, "epochs", "must be >= 1")
        require(self.shard_adopt_after_s > 0, "shard_adopt_after_s", "must be positive")
        self.assigned_shards()  # RotationError (a DataError) names a bad range

    def assigned_shards(self) -> frozenset[int] | None:
        """The shard ids of ``shard_ranges`` (None: every shard)."""
        return None if self.shard_ranges is None else parse_ranges(self.shard_ranges)
