"""The virtual loop's own timer heap: due order, ties in the order made, cancelled timers
never run and do not pile up, and the clock jumps only to what is due."""

from __future__ import annotations

import asyncio

from agora_sim.loop import VirtualClock, VirtualLoop


def test_timers_run_by_due_time_ties_in_the_order_made_and_cancelled_ones_never():
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    ran: list[tuple[float, int]] = []
    try:
        start = loop.time()
        handles = [
            loop.call_at(start + 1.0 + (i % 3), lambda i=i: ran.append((loop.time(), i))) for i in range(300)
        ]
        for handle in handles[::2]:  # half cancelled: more than half of what waits, so purged
            handle.cancel()
        done = loop.create_future()
        loop.call_at(start + 10.0, done.set_result, None)
        loop.run_until_complete(done)
    finally:
        loop.close()
    kept = [i for i in range(300) if i % 2]
    assert [i for _, i in ran] == sorted(kept, key=lambda i: (i % 3, i))  # due time, then made
    assert [t - start for t, _ in ran] == [1.0 + (i % 3) for i in sorted(kept, key=lambda i: (i % 3, i))]
    assert clock.elapsed_s == 10.0  # the clock jumped straight to each due time, no further
    assert loop._timer_cancelled_count == 0  # every cancelled handle left the heap


def test_a_purge_of_cancelled_timers_keeps_the_live_ones_and_asyncio_sleeps_follow_the_clock():
    clock = VirtualClock()
    loop = VirtualLoop(clock)
    try:
        far = [loop.call_later(1000.0 + i, lambda: None) for i in range(500)]
        for handle in far[:400]:
            handle.cancel()

        async def nap() -> float:
            started = loop.time()
            await asyncio.sleep(2.5)
            return loop.time() - started

        assert loop.run_until_complete(nap()) == 2.5
        assert len(loop._timers) == 100  # the 400 cancelled were dropped in one purge
        assert all(not entry[2].cancelled() for entry in loop._timers)
    finally:
        loop.close()
