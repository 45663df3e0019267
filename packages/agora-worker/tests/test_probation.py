"""A joiner's first serving round, held against the distances its stage's peers published."""

from __future__ import annotations

import asyncio

from agora_core.dht import DhtError
from agora_worker.averaging.averager import RoundReport
from agora_worker.joining import JoinProbation


def report(
    distance: float, *, group_size: int = 3, success: float = 1.0, round_index: int = 7
) -> RoundReport:
    return RoundReport(round_index, 3, group_size, 1.0, success, 0.1, 1000, distance=distance)


async def judged(summaries, distance: float, **kwargs) -> tuple[JoinProbation, list[str]]:
    """A probation that joined and saw one round at ``distance``; the resyncs it asked for."""
    resyncs: list[str] = []

    async def peer_summaries():
        if isinstance(summaries, Exception):
            raise summaries
        return summaries

    probation = JoinProbation(ratio=10.0, peer_summaries=peer_summaries, resync=resyncs.append)
    probation.joined()
    probation.on_round(report(distance, **kwargs), serving=True)
    while probation._tasks:
        await asyncio.gather(*probation._tasks)
    return probation, resyncs


async def test_a_joiner_far_from_its_group_goes_back_to_sync_one_near_it_stays():
    averaged = {"group_size": 3, "averaging_success": 1.0}
    peers = [{"distance": d, **averaged} for d in (0.010, 0.012, 0.5)]  # one liar, or a laggard
    far, resyncs = await judged(peers, 3.0)
    assert len(resyncs) == 1 and "250.0x the median 0.012 of 3 peers" in resyncs[0]
    assert far.verdicts == [{"round": 7, "distance": 3.0, "peers": 3, "reference": 0.012, "passed": False}]
    near, resyncs = await judged(peers, 0.05)
    assert resyncs == [] and near.verdicts[0]["passed"]
    assert not near.pending  # judged once: its later rounds are its stage's business


async def test_only_an_averaged_round_in_serving_is_judged():
    peers = [{"distance": 0.01, "group_size": 3, "averaging_success": 1.0}] * 3
    for kwargs in ({"group_size": 1}, {"success": 0.0}):
        probation, resyncs = await judged(peers, 9.0, **kwargs)
        assert probation.pending and resyncs == [] and probation.verdicts == []
    probation, resyncs = await judged(peers, 9.0)
    probation.joined()
    probation.left()  # back in sync before a round: nothing to judge
    probation.on_round(report(9.0), serving=True)
    assert not probation._tasks
    syncing = JoinProbation(ratio=10.0, peer_summaries=None, resync=resyncs.append)
    syncing.joined()
    syncing.on_round(report(9.0), serving=False)
    assert syncing.pending and not syncing._tasks
    off = JoinProbation(ratio=0.0, peer_summaries=None, resync=resyncs.append)
    off.joined()
    assert not off.pending  # ratio 0: the check is off


async def test_what_peers_say_is_checked_and_no_figure_means_no_verdict():
    averaged = {"group_size": 3, "averaging_success": 1.0}
    junk = [{"distance": d, **averaged} for d in ("0.01", float("nan"), -1.0, True, None)]
    # rounds that averaged nothing report 0: alone, matchmaking failed, nothing came back
    junk += [{"distance": 0.0, **averaged}, {"distance": 0.01, "group_size": 1, "averaging_success": 0.0}]
    junk += [{"distance": 0.01, "group_size": 3, "averaging_success": 0.0}]
    probation, resyncs = await judged(junk, 50.0)
    assert resyncs == [] and probation.verdicts[0]["reference"] is None
    probation, resyncs = await judged(DhtError("unreachable"), 50.0)
    assert resyncs == [] and probation.verdicts == []
