"""A node's startup heap, settled once it serves (agora_core.node.heap)."""

from __future__ import annotations

import gc
import weakref

from agora_core.node.heap import settle_startup_heap


class Node:
    pass


def a_cycle() -> Node:
    node = Node()
    node.self = node  # only the cyclic collector can free it once it is unreachable
    return node


def test_a_settled_heap_is_frozen_and_later_cycles_are_still_collected():
    held = a_cycle()
    before = weakref.ref(held)
    try:
        # Other tests' threads may free frozen objects meanwhile, so the count is a floor only.
        assert settle_startup_heap() > 1000  # the interpreter's own heap at least
        after = weakref.ref(a_cycle())
        del held  # reachable at the freeze, unreachable now
        gc.collect()
        assert before() is not None  # exempt: the collector no longer scans it
        assert after() is None  # allocated after the freeze: collected as ever
    finally:
        gc.unfreeze()  # leave the test process as it was
    gc.collect()
    assert before() is None  # unfrozen, it is collected again
