"""Device-memory gauges: a CUDA worker's allocator counters; none at all on a CPU worker."""

from __future__ import annotations

import pytest
import torch

from agora_core.observability.metrics import NodeMetrics
from agora_worker.serving.device_metrics import export_device_memory

NAMES = ("allocated", "reserved", "peak", "total")


def test_a_cpu_worker_exports_no_device_memory():
    metrics = NodeMetrics(role="worker", stage=0)
    assert export_device_memory(metrics, torch.device("cpu")) is False
    assert "agora_worker_device_memory" not in metrics.exposition().decode()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_worker_exports_what_its_tensors_hold():
    metrics = NodeMetrics(role="worker", stage=0)
    device = torch.device("cuda:0")
    assert export_device_memory(metrics, device) is True
    before = metrics.sample_value("agora_worker_device_memory_allocated_bytes")
    held = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # 64 MiB
    try:
        assert metrics.sample_value("agora_worker_device_memory_allocated_bytes") >= before + (64 << 20)
        assert metrics.sample_value("agora_worker_device_memory_reserved_bytes") >= 64 << 20
        total = metrics.sample_value("agora_worker_device_memory_total_bytes")
        assert total == torch.cuda.get_device_properties(0).total_memory
    finally:
        del held
    for name in NAMES:
        assert metrics.sample_value(f"agora_worker_device_memory_{name}_bytes") is not None
