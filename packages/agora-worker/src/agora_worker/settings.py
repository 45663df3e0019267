"""Node-local settings of a worker (the run config says what to train; this says how here)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from agora_core.config import require
from agora_core.contract import Phase

CPU_BATCH_SAMPLES = 32


@dataclass(kw_only=True, frozen=True)
class WorkerSettings:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Largest coalesced microbatch; None sizes it from the device's memory.
    max_batch_samples: int | None = None
    max_batch_tokens: int | None = None  # default: max_batch_samples * seq_len
    progress_interval_s: float = 1.0  # how often stage progress is published and read
    announce_interval_s: float = 2.0  # how often the announcement is refreshed (expiry: 3x)
    shutdown_grace_s: float = 30.0  # in-flight requests get this long to finish on SIGTERM
    surrogate_delay_scale: float = 1.0  # surrogate stages only: this node is this much slower
    # Operators and tests only: pin the worker to one phase for good (None: the sync phases
    # run by themselves). serving: full participant. weight_sync: invisible to trainers,
    # averages with weight 0. optimizer_sync: serves, but its samples do not count.
    phase: Phase | None = None
    # When to download the stage's state from live replicas: auto (when they are more than
    # sync.stale_after_steps ahead), always (whenever one exists), never.
    download: Literal["auto", "always", "never"] = "auto"
    # Write checkpoints here (every [checkpoint] every_steps steps and on a clean stop); one
    # directory per worker. None: no checkpoints.
    checkpoint_dir: str | None = None
    resume: bool = False  # start from the newest valid checkpoint in checkpoint_dir, if any

    def __post_init__(self) -> None:
        if self.phase is not None:
            require(self.phase in set(Phase), "phase", f"must be one of {', '.join(Phase)}")
            object.__setattr__(self, "phase", Phase(self.phase))  # a name given as a string
        require(self.download in ("auto", "always", "never"), "download", "must be auto, always or never")
        require(
            self.max_batch_samples is None or self.max_batch_samples >= 1, "max_batch_samples", "must be >= 1"
        )
        require(
            self.max_batch_tokens is None or self.max_batch_tokens >= 1, "max_batch_tokens", "must be >= 1"
        )
        for name in (
            "progress_interval_s",
            "announce_interval_s",
            "shutdown_grace_s",
            "surrogate_delay_scale",
        ):
            require(getattr(self, name) > 0, name, "must be positive")
        require(
            not self.resume or bool(self.checkpoint_dir), "resume", "needs a checkpoint_dir to resume from"
        )


def batch_limits(
    settings: WorkerSettings, device: torch.device, *, seq_len: int, bytes_per_token: int
) -> tuple[int, int]:
    """(samples, tokens) per microbatch: as configured, else what the device memory allows.

    ``bytes_per_token`` estimates the activation memory one token costs in a stage's recomputed
    forward and backward; a quarter of free accelerator memory is left for everything else.
    """
    samples = settings.max_batch_samples
    if samples is None:
        if device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            samples = max(1, int(0.75 * free) // max(1, bytes_per_token * seq_len))
        else:
            samples = CPU_BATCH_SAMPLES
    tokens = settings.max_batch_tokens or samples * seq_len
    return samples, tokens
