"""The accelerator memory a worker's torch uses, exported as gauges read when collected.

CUDA only: a CPU worker has no device memory of its own to report and exports none of these
(agora-core's ``agora_host_rss_bytes`` covers its host memory). The readings are the caching
allocator's counters: they never synchronize the device, so a scrape or push from another
thread costs nothing on the compute thread, even while a kernel runs.
"""

from __future__ import annotations

import torch

from agora_core.observability.metrics import NodeMetrics


def export_device_memory(metrics: NodeMetrics, device: torch.device) -> bool:
    """Declare the device-memory gauges of ``device`` on ``metrics``; False (none declared)
    unless it is a CUDA device."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    allocated = metrics.gauge(
        "agora_worker_device_memory_allocated_bytes", "Device memory held by live tensors."
    )
    allocated.set_function(lambda: torch.cuda.memory_allocated(index))
    reserved = metrics.gauge(
        "agora_worker_device_memory_reserved_bytes", "Device memory reserved by torch's caching allocator."
    )
    reserved.set_function(lambda: torch.cuda.memory_reserved(index))
    peak = metrics.gauge(
        "agora_worker_device_memory_peak_bytes", "Most device memory live tensors held at once so far."
    )
    peak.set_function(lambda: torch.cuda.max_memory_allocated(index))
    total = metrics.gauge("agora_worker_device_memory_total_bytes", "The device's memory.")
    total.set(torch.cuda.get_device_properties(index).total_memory)
    return True


def device_memory_info(device: torch.device) -> dict | None:
    """``worker.info``'s ``device_memory``: the same counters now, in bytes (None off CUDA)."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {
        "allocated": torch.cuda.memory_allocated(index),
        "reserved": torch.cuda.memory_reserved(index),
        "peak": torch.cuda.max_memory_allocated(index),
        "total": torch.cuda.get_device_properties(index).total_memory,
    }
