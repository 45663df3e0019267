"""A joiner's first averaging round in serving, held against its stage's other replicas.

A worker that downloaded its state and synced serves on weights it never trained with, and
its first round in serving is the first time those weights count in its stage's average. That
round's distance (``RoundReport.distance``: ||average - own|| / ||own|| over the averaged
part of its segment) is compared with the distances its peers published for their own latest
rounds. A joiner more than ``sync.max_join_distance_ratio`` times their median away is no
replica of its stage, whatever broke it: it goes back to weight sync, where it averages at
weight 0 until the stage has pulled it in, and says so.

The peers' distances are their own word: the median of several bounds what one liar can do,
and the worst a lie can do is send a joiner through sync once more. Distances that are no
finite number > 0, and those of rounds that averaged nothing (a peer alone, its matchmaking
failed, it was excluded: such a report says 0), are dropped.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Awaitable, Callable

from agora_core.dht import DhtError
from agora_core.errors import RpcError
from agora_core.observability.logs import get_logger
from agora_worker.averaging.averager import RoundReport

log = get_logger("worker.probation")


class JoinProbation:
    def __init__(
        self,
        *,
        ratio: float,
        peer_summaries: Callable[[], Awaitable[list[dict]]],
        resync: Callable[[str], None],
    ):
        """``ratio``: ``sync.max_join_distance_ratio`` (0: never judged); ``peer_summaries()``
        the stage's other workers' latest round reports; ``resync(reason)`` sends the worker
        back to weight sync."""
        self._ratio = ratio
        self._peer_summaries = peer_summaries
        self._resync = resync
        self.pending = False  # the next averaged round in serving is judged
        self.verdicts: list[dict] = []  # every judgement, for worker.info and tests
        self._tasks: set[asyncio.Task] = set()

    def joined(self) -> None:
        """The worker entered serving out of a sync phase: judge its next averaged round."""
        self.pending = bool(self._ratio)

    def left(self) -> None:
        """It went back to a sync phase before a round was judged."""
        self.pending = False

    def on_round(self, report: RoundReport, *, serving: bool) -> None:
        """After every averaging round (on the event loop)."""
        if not (self.pending and serving) or report.group_size < 2 or report.averaging_success <= 0:
            return
        self.pending = False
        task = asyncio.get_running_loop().create_task(self._judge(report))
        self._tasks.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._tasks.discard)

    async def _judge(self, report: RoundReport) -> None:
        try:
            summaries = await self._peer_summaries()
        except (DhtError, RpcError) as exc:
            log.warning("join_probation_unjudged", round=report.round, error=str(exc))
            return
        # a peer's round that averaged nothing (alone, failed, excluded) measured no distance
        theirs = [
            float(s["distance"])
            for s in summaries
            if _distance(s.get("distance")) and _averaged(s) and s["distance"] > 0
        ]
        verdict = {"round": report.round, "distance": report.distance, "peers": len(theirs)}
        if not theirs:
            log.info("join_probation_unjudged", round=report.round, reason="no peer published a distance")
            self.verdicts.append({**verdict, "reference": None, "passed": None})
            return
        reference = statistics.median(theirs)
        passed = report.distance <= self._ratio * reference or report.distance == 0.0
        self.verdicts.append({**verdict, "reference": reference, "passed": passed})
        log.info(
            "join_probation_judged",
            round=report.round,
            distance=report.distance,
            peers_median=reference,
            peers=len(theirs),
            passed=passed,
        )
        if not passed:
            times = report.distance / reference if reference > 0 else math.inf
            self._resync(
                f"its first serving round stood {report.distance:.3g} from the average, "
                f"{times:.1f}x the median {reference:.3g} of {len(theirs)} peers"
            )


def _averaged(summary: dict) -> bool:
    group, success = summary.get("group_size"), summary.get("averaging_success")
    return _distance(group) and group >= 2 and _distance(success) and success > 0


def _distance(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )
