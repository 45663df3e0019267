"""The coalescing limit of a CUDA worker, from device memory measured, not guessed.

Before it serves, the worker runs warm-up microbatches of its own stage through its backend,
as training runs them (recomputed forward, backward, gradients accumulated): one sample to
settle kernels and allocate the step's gradients, then one sample and two samples, reading the
allocator's peak for each. Their difference is what one more sample costs; the peak of the
two-sample one holds everything else (weights, fixed parts, the step's gradients, a
microbatch's own). The limit is the largest batch whose projected peak fits in ``headroom`` of
the memory torch may use: what the driver reports free plus what torch's cache holds. The
warm-up leaves no trace: its gradients and samples are dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from agora_core.contract import StageRole
from agora_core.observability.logs import get_logger
from agora_worker.serving.backend import StageBackend

log = get_logger("worker.memory")

HEADROOM = 0.9  # of usable device memory a microbatch's peak may take: fragmentation, transfers
MAX_SAMPLES = 4096  # a sanity bound: a stage whose samples cost (almost) nothing


@dataclass(frozen=True)
class MemoryReading:
    one_sample_peak_bytes: int
    two_sample_peak_bytes: int
    usable_bytes: int  # free on the device plus torch's cached blocks
    max_samples: int


def measure_batch_limit(
    backend: StageBackend,
    *,
    role: StageRole,
    seq_len: int,
    vocab_size: int,
    boundary_width: int,
    headroom: float = HEADROOM,
) -> MemoryReading:
    """Run the warm-up microbatches on ``backend``'s CUDA device and size the limit."""
    device = backend.device
    if device.type != "cuda":
        raise ValueError(f"measuring the batch limit needs a CUDA device, not {device}")
    optimizer = backend.optimizer
    total_before = optimizer.total_samples
    generator = torch.Generator().manual_seed(0)

    def microbatch(samples: int) -> int:
        tokens = torch.randint(0, vocab_size, (samples, seq_len), generator=generator)
        payload = torch.randn(samples, seq_len, boundary_width, generator=generator)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        if role == StageRole.TAIL:
            backend.forward_backward(tokens, payload, tokens)
        else:
            boundary = None if role == StageRole.HEAD else payload
            backend.backward(tokens, boundary, torch.randn(samples, seq_len, boundary_width))
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)

    try:
        microbatch(1)
        one = microbatch(1)  # now with the step's gradients held, as in training
        try:
            two = microbatch(2)
        except torch.cuda.OutOfMemoryError:
            two = None
        free, _total = torch.cuda.mem_get_info(device)
        usable = free + torch.cuda.memory_reserved(device)
    finally:
        optimizer.discard_gradients()
        optimizer.total_samples = total_before
    if two is None:
        limit = 1
    else:
        per_sample = max(1, two - one)
        limit = 2 + int((headroom * usable - two) // per_sample)
    reading = MemoryReading(one, two or 0, usable, max(1, min(MAX_SAMPLES, limit)))
    torch.cuda.empty_cache()
    log.info("batch_limit_measured", **dataclasses.asdict(reading))
    return reading
