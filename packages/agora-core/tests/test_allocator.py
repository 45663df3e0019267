"""glibc malloc tuning: chunk-sized buffers are reused instead of faulted in afresh."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from agora_core.allocator import tune_for_large_messages

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Each cycle holds eight 2 MiB chunks at once, then frees them all: the pattern of a reducer's
# round. Untuned, glibc hands the freed heap top back to the kernel, so every cycle faults its
# 16 MiB in again; tuned, the next cycle reuses it.
_CYCLES = """
import json, resource, sys
import numpy as np
from agora_core.allocator import tune_for_large_messages
applied = tune_for_large_messages()
def cycle():
    chunks = [np.ones(512 * 1024, np.float32) for _ in range(8)]
    return sum(float(c[-1]) for c in chunks)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    cycle()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"applied": applied, "faults_per_cycle": faults}))
"""


def _run_cycles(tuning: str) -> dict:
    env = {**os.environ, "AGORA_MALLOC_TUNING": tuning}
    out = subprocess.run(
        [sys.executable, "-c", _CYCLES], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_tuned_malloc_reuses_chunk_buffers_instead_of_faulting_them_in():
    untuned = _run_cycles("0")
    tuned = _run_cycles("1")
    assert untuned["applied"] is False and tuned["applied"] is True
    # 16 MiB per cycle is ~4096 pages: untuned pays most of them every cycle
    assert untuned["faults_per_cycle"] > 2000
    assert tuned["faults_per_cycle"] < untuned["faults_per_cycle"] / 10


def test_thresholds_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        tune_for_large_messages(mmap_threshold_bytes=0)
    with pytest.raises(ValueError, match="positive"):
        tune_for_large_messages(trim_threshold_bytes=-1)
