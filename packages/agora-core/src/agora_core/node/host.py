"""What a node reads about its own process on the host: its resident memory.

Shared by the metrics every node exports (``agora_host_rss_bytes``) and the worker's
host-memory self-termination rule, so both read the same number.
"""

from __future__ import annotations

import os
import resource
import sys


def host_rss_bytes() -> int:
    """This process's resident set size now (Linux: /proc/self/statm), else its peak."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere
