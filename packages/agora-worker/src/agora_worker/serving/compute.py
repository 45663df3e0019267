"""A worker's compute on its device: the stage module, its host optimizer, the backend that
runs microbatches, and the microbatch limits, built from the run config and node settings.

The device is the setting's (``auto``: CUDA when present). On CUDA the trained weights' compute
copy is fp32 or, with ``compute_weights = "bf16"``, bf16; the masters are fp32 on the host
either way and the two meet once per step (``transfers``). A CPU worker holds one fp32 copy
and refuses bf16 compute weights: it runs without autocast, and fp32 inputs against bf16
weights would be neither fast nor the numerics every other replica trains with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from agora_core.config import RunConfig
from agora_core.errors import ConfigError
from agora_core.observability.metrics import NodeMetrics
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.optimizer.transfers import TransferEngine
from agora_worker.serving.backend import BOUNDARY_DTYPES, StageBackend, pick_device
from agora_worker.serving.device_metrics import export_device_memory
from agora_worker.serving.memory import measure_batch_limit
from agora_worker.settings import WorkerSettings, batch_limits

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # WorkerSettings.compute_weights


@dataclass(frozen=True)
class StageCompute:
    device: torch.device
    module: nn.Module
    optimizer: HostOptimizer
    backend: StageBackend
    max_batch_samples: int
    max_batch_tokens: int


def build_compute(run: RunConfig, stage: int, settings: WorkerSettings, metrics: NodeMetrics) -> StageCompute:
    device = pick_device(settings.device)
    if settings.compute_weights != "fp32" and device.type != "cuda":
        raise ConfigError(
            "compute_weights",
            f"{settings.compute_weights} compute weights need a CUDA device; this worker computes "
            f"on {device} (no autocast there): leave it at fp32",
        )
    export_device_memory(metrics, device)  # a CUDA device's only
    module = build_stage(run, stage, delay_scale=settings.surrogate_delay_scale).to(device)
    optimizer = HostOptimizer(
        module,
        run.optimizer,
        clip_threshold=run.clipping.threshold(stage, run.model.n_stages),
        compute_dtype=COMPUTE_DTYPES[settings.compute_weights],
    )
    if optimizer.transfers is not None:
        export_transfers(metrics, optimizer.transfers)
    backend = StageBackend(
        module,
        optimizer,
        device,
        boundary_dtype=BOUNDARY_DTYPES[run.transport.boundary_dtype],
        weight_versions=run.optimizer.weight_versions,
        stale_gradients=run.optimizer.stale_gradients,
    )
    samples, tokens = batch_limits(
        settings,
        device,
        seq_len=run.model.seq_len,
        measure=lambda: (
            measure_batch_limit(
                backend,
                role=module.role,
                seq_len=run.model.seq_len,
                vocab_size=run.model.vocab_size,
                boundary_width=module.boundary_width,
            ).max_samples
        ),
    )
    return StageCompute(device, module, optimizer, backend, samples, tokens)


def export_transfers(metrics: NodeMetrics, engine: TransferEngine) -> None:
    """Counters of the host <-> device transfers, read from the engine when collected."""
    counts = engine.counts
    metrics.counter_from(
        "agora_worker_host_transfers_total",
        "Whole-set transfers between host and device (step gradients down, weights up).",
        ("direction",),
        lambda: {("to_host",): float(counts.to_host), ("to_device",): float(counts.to_device)},
    )
    metrics.counter_from(
        "agora_worker_host_transfer_bytes_total",
        "Bytes moved between host and device by those transfers.",
        ("direction",),
        lambda: {("to_host",): float(counts.bytes_to_host), ("to_device",): float(counts.bytes_to_device)},
    )
    metrics.counter_from(
        "agora_worker_host_transfer_wait_seconds_total",
        "Seconds the compute thread blocked on host <-> device copies.",
        (),
        lambda: {(): counts.wait_s},
    )


def transfer_info(optimizer: HostOptimizer) -> dict | None:
    """``worker.info``'s ``transfers``: the engine's totals (None: one shared copy)."""
    engine = optimizer.transfers
    return None if engine is None else dataclasses.asdict(engine.counts)
