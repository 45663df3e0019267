"""glibc malloc tuning: chunk-sized buffers are reused instead of faulted in afresh."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from agora_core.node.allocator import tune_for_large_messages

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")

# Each cycle holds eight 2 MiB chunks at once, then frees them all: the pattern of a reducer's
# round. Untuned, glibc hands the freed heap top back to the kernel, so every cycle faults its
# 16 MiB in again; tuned, the next cycle reuses it.
# argv: chunks held per cycle, whether the cycles run in a thread of their own (its own arena)
_CYCLES = """
import json, resource, sys, threading
import numpy as np
from agora_core.node.allocator import tune_for_large_messages
applied = tune_for_large_messages()
held, in_thread = int(sys.argv[1]), sys.argv[2] == "thread"
def cycle():
    chunks = [np.ones(512 * 1024, np.float32) for _ in range(held)]
    return sum(float(c[-1]) for c in chunks)
def cycles(out):
    cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        cycle()
    out.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
faults = []
if in_thread:
    worker = threading.Thread(target=cycles, args=(faults,))
    worker.start()
    worker.join()
else:
    cycles(faults)
print(json.dumps({"applied": applied, "faults_per_cycle": faults[0]}))
"""


def _run_cycles(tuning: str, held: int, where: str) -> dict:
    env = {**os.environ, "AGORA_MALLOC_TUNING": tuning}
    out = subprocess.run(
        [sys.executable, "-c", _CYCLES, str(held), where],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
@pytest.mark.parametrize(
    ("held", "where"),
    [
        (8, "main"),  # 16 MiB, on the main heap
        # 96 MiB from a thread: more than one 64 MiB heap of its arena, whose second heap is
        # unmapped each time it empties unless the top pad keeps it
        (48, "thread"),
    ],
)
def test_tuned_malloc_reuses_chunk_buffers_instead_of_faulting_them_in(held, where):
    untuned = _run_cycles("0", held, where)
    tuned = _run_cycles("1", held, where)
    assert untuned["applied"] is False and tuned["applied"] is True
    # 2 MiB is 512 pages: untuned pays a good part of them for every chunk of every cycle
    # (glibc's adaptive mmap threshold moves chunks to the heap after a while; the thread's
    # second heap still comes and goes)
    assert untuned["faults_per_cycle"] > held * 128
    assert tuned["faults_per_cycle"] < untuned["faults_per_cycle"] / 10


def test_thresholds_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        tune_for_large_messages(mmap_threshold_bytes=0)
    with pytest.raises(ValueError, match="positive"):
        tune_for_large_messages(trim_threshold_bytes=-1)
