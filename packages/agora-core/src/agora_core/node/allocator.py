"""glibc malloc settings for nodes that move large tensors: chunk-sized buffers stay on the heap.

Blocks up to ``mmap_threshold_bytes`` are heap-served, the heap keeps ``trim_threshold_bytes``
free at its top and each thread arena one heap of pad, so a message's buffers are reused, not
mapped and faulted in afresh. Why, and what it saved: the agora-core README ("Malloc tuning").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

from agora_core.observability.logs import get_logger

log = get_logger("core.allocator")

_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest allowed: heap-served up to here
TRIM_THRESHOLD_BYTES = 256 * 1024 * 1024  # free heap top kept before giving memory back
TOP_PAD_BYTES = 64 * 1024 * 1024  # a thread arena's heap (2 x glibc's largest mmap threshold)
ENV_SWITCH = "AGORA_MALLOC_TUNING"


def tune_for_large_messages(
    *,
    mmap_threshold_bytes: int = MMAP_THRESHOLD_BYTES,
    trim_threshold_bytes: int = TRIM_THRESHOLD_BYTES,
) -> bool:
    """Apply the thresholds and the top pad to this process's malloc; True when they took effect.

    Call it once, early in a node's process (before the hot path allocates). Safe to call
    again; does nothing when ``AGORA_MALLOC_TUNING=0`` or the C library is not glibc.
    """
    if mmap_threshold_bytes <= 0 or trim_threshold_bytes <= 0:
        raise ValueError("malloc thresholds must be positive byte counts")
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = (
        bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold_bytes))
        and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold_bytes))
        and bool(mallopt(_M_TOP_PAD, TOP_PAD_BYTES))
    )
    if not applied:  # glibc refuses an mmap threshold above its maximum
        log.warning("malloc_tuning_refused", mmap_threshold_bytes=mmap_threshold_bytes)
    return applied
