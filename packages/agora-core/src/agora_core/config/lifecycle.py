"""The run config's sections for a worker's life in a run: joining its stage (state download
and sync phases), checkpoints, and the rules by which it terminates itself.

Defaults follow the published run where its report states them (marked "report").
"""

from __future__ import annotations

from dataclasses import dataclass

from agora_core.config.loader import MiB, require


@dataclass(kw_only=True, frozen=True)
class SyncConfig:
    # report: a stale joiner first averages at weight 0 for a full pass of SPARTA
    # (20 rounds x 20 steps), then warms its optimizer on live batches for 100 steps.
    # A worker that downloaded its state from peers passes through both phases.
    weight_sync_steps: int = 400
    optimizer_sync_steps: int = 100
    # A starting worker whose own state (initial weights or a checkpoint) is more than this
    # many steps behind its stage's live replicas downloads theirs; a serving worker that
    # falls this far behind its stage re-enters weight sync.
    stale_after_steps: int = 20
    # A joiner's first averaging round in serving: if its weights stood more than this many
    # times farther from the group's average than its serving peers' did in their last rounds,
    # it is no replica of its stage and goes back to weight sync; 0 turns the check off.
    max_join_distance_ratio: float = 10.0

    def __post_init__(self) -> None:
        for name in ("weight_sync_steps", "optimizer_sync_steps", "stale_after_steps"):
            require(getattr(self, name) >= 0, name, "must be >= 0")
        require(
            self.max_join_distance_ratio == 0 or self.max_join_distance_ratio >= 1,
            "max_join_distance_ratio",
            "must be 0 (off) or >= 1",
        )


@dataclass(kw_only=True, frozen=True)
class JoinConfig:
    """How a joining worker downloads its stage's state from live replicas (donors)."""

    max_donors: int = 3  # replicas downloaded from at once
    # One fetch request's share of a tensor. Several in flight per donor keep a link busy
    # across its round trip: 4 x 4 MiB covers 200 Mbit/s at up to ~0.6 s RTT.
    piece_bytes: int = 4 * MiB
    pieces_in_flight: int = 4
    piece_timeout_s: float = 30.0  # a donor missing it is dropped; its pieces go to another
    manifest_timeout_s: float = 60.0  # the donor's snapshot and its digests
    snapshot_ttl_s: float = 120.0  # a donor drops a snapshot no fetch touched for this long
    attempts: int = 3  # discover-and-download tries before the worker gives up on peers

    def __post_init__(self) -> None:
        for name in ("max_donors", "pieces_in_flight", "attempts"):
            require(getattr(self, name) >= 1, name, "must be >= 1")
        require(4096 <= self.piece_bytes <= 64 * MiB, "piece_bytes", "must lie in [4 KiB, 64 MiB]")
        for name in ("piece_timeout_s", "manifest_timeout_s", "snapshot_ttl_s"):
            require(getattr(self, name) > 0, name, "must be positive")


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Checkpoints a worker writes with ``--checkpoint-dir``."""

    every_steps: int = 100  # optimizer steps between checkpoints
    keep: int = 3  # the newest this many are kept; older ones are deleted

    def __post_init__(self) -> None:
        require(self.every_steps >= 1, "every_steps", "must be >= 1")
        require(self.keep >= 1, "keep", "must be >= 1")


@dataclass(kw_only=True, frozen=True)
class TerminationConfig:
    """When a worker stops itself (report 3.3.1.6): each rule has its threshold; 0 turns it off.

    A worker that trips a rule withdraws its announcement, publishes a signed departure record
    saying why, leaves the DHT and exits with the rule's code (agora-worker's README).
    """

    check_interval_s: float = 1.0  # how often the rules are evaluated
    # report: a CUDA failure terminates at once. A failed merged batch is retried request by
    # request, so one bad request fails alone among successes; a broken device fails every
    # request. Failed requests in a row, no success between: 3 trips within three requests of
    # the device breaking, never on one bad request.
    compute_failures: int = 3
    # report: invalid values in the gradients terminate at once. Optimizer steps in a row whose
    # gradient norm was NaN or infinite (each such gradient is dropped, not applied).
    nonfinite_steps: int = 1
    # report: loss of peer-to-peer connectivity terminates. Seconds with no other live DHT
    # member, or with no DHT operation succeeding. assumed: 60 s rides out a slow or flaky
    # link; by then the worker's announcement has long expired and trainers cannot see it.
    unreachable_s: float = 60.0
    # report: a worker that cannot fetch the run's progress terminates. Seconds this worker
    # holds samples toward a step while the stage's step, as read from the DHT, stays put (an
    # idle worker never trips it). assumed: 600 s, many steps' time at the run's batch size.
    no_progress_s: float = 600.0
    # report: a worker whose host RAM usage exceeds a configured limit exits before it degrades.
    # Resident set size of the worker process, MiB; machines differ, so no default limit.
    max_host_rss_mib: int = 0
    # report: two failures within any three consecutive averaging rounds (not only two in a
    # row). A round fails for this worker when it had peers to average with and got none of its
    # segment's average back, or when it could not form a group; rounds it was alone in do not
    # count. failed_rounds = 0: off.
    failed_rounds: int = 2
    rounds_window: int = 3
    # How long the departure record stays readable (a monitor polls every few minutes). Must fit
    # under dht.max_expiration_ahead_s less dht.max_clock_skew_s, or replicas refuse it.
    departure_ttl_s: float = 3000.0

    def __post_init__(self) -> None:
        require(self.check_interval_s > 0, "check_interval_s", "must be positive")
        for name in (
            "compute_failures",
            "nonfinite_steps",
            "unreachable_s",
            "no_progress_s",
            "max_host_rss_mib",
            "failed_rounds",
        ):
            require(getattr(self, name) >= 0, name, "must be >= 0 (0: the rule is off)")
        require(self.rounds_window >= 1, "rounds_window", "must be >= 1")
        require(
            self.failed_rounds <= self.rounds_window,
            "failed_rounds",
            f"must not exceed rounds_window ({self.rounds_window})",
        )
        require(self.departure_ttl_s > 0, "departure_ttl_s", "must be positive")
