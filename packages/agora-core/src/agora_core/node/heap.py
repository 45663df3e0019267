"""A long-running node's heap, settled once it has started.

Everything a node builds to start (modules, torch, the model, the run config, its tables)
lives as long as the node does, yet CPython's cyclic collector scans all of it on every full
collection: with a hundred thousand objects such a pass stalls the event loop for over 100 ms
(measured in benchmarks/dht.py's in-process swarms), and the calls waiting on the loop meanwhile
make a latency tail. Freezing the startup heap leaves the collector only what was allocated
since. Reference counting still frees those frozen objects that die; only cycles among them
would stay, and a collection right before the freeze clears the cycles of startup.
"""

from __future__ import annotations

import gc


def settle_startup_heap() -> int:
    """Collect once, then exempt every object alive now from cyclic collection; returns how
    many objects are exempt. Call once a node serves; calling again adds what came since."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
