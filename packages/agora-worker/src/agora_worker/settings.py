"""Node-local settings of a worker (the run config says what to train; this says how here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from agora_core.config import require
from agora_core.contract import Phase

CPU_BATCH_SAMPLES = 32


@dataclass(kw_only=True, frozen=True)
class WorkerSettings:
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # Largest coalesced microbatch; None: on CUDA, sized from the free device memory measured
    # after warm-up microbatches (agora_worker.serving.memory); on a CPU, CPU_BATCH_SAMPLES.
    max_batch_samples: int | None = None
    max_batch_tokens: int | None = None  # default: max_batch_samples * seq_len
    # how often a busy worker decides between the wake-ups of landed backwards and pushes
    progress_interval_s: float = 1.0
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
    # The device's copy of the trained weights: fp32, or bf16 to halve the device memory they
    # take (and the bytes of each upload); the masters and AdamW stay fp32 on the host either
    # way. CUDA only: a CPU worker computes without autocast, in fp32, and refuses bf16.
    compute_weights: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        if self.phase is not None:
            require(self.phase in set(Phase), "phase", f"must be one of {', '.join(Phase)}")
            object.__setattr__(self, "phase", Phase(self.phase))  # a name given as a string
        require(self.download in ("auto", "always", "never"), "download", "must be auto, always or never")
        require(self.compute_weights in ("fp32", "bf16"), "compute_weights", "must be fp32 or bf16")
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
    settings: WorkerSettings, device: torch.device, *, seq_len: int, measure: Callable[[], int]
) -> tuple[int, int]:
    """(samples, tokens) per microbatch: as configured, else what ``measure()`` finds the
    device memory allows (CUDA), else CPU_BATCH_SAMPLES."""
    samples = settings.max_batch_samples
    if samples is None:
        samples = measure() if device.type == "cuda" else CPU_BATCH_SAMPLES
    tokens = settings.max_batch_tokens or samples * seq_len
    return samples, tokens
