"""A node's startup heap, settled once it serves (agora_core.heap)."""

from __future__ import annotations

import gc
import weakref

from agora_core.heap import settle_startup_heap


def test_a_settled_heap_is_frozen_and_later_cycles_are_still_collected():
    class Node:
        pass

    try:
        frozen = settle_startup_heap()
        assert frozen > 1000 and gc.get_freeze_count() == frozen  # the interpreter's own heap at least
        cycle = Node()
        cycle.self = cycle
        alive = weakref.ref(cycle)
        del cycle
        gc.collect()
        assert alive() is None  # allocated after the freeze: collected as ever
    finally:
        gc.unfreeze()  # leave the test process as it was
