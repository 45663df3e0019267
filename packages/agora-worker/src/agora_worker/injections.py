"""A worker's side of failure injection: the watch on the operator's records, and its effects.

The hook points (``Worker.injections``) sit in the pipeline handlers (forward, backward:
a request computed, its reply not yet sent), the averaging sender's chunk loop and the state
download's piece requests; see ``agora_core.injection``. The effects a worker offers: its
compute thread slows down (``slow``: every microbatch takes factor x as long), its RPC port
falls silent (``drop_link``), its next returned input gradient is NaN (``nan``; the head
returns none, so for the head it is not applicable).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agora_core.contract import StageRole
from agora_core.injection import InjectionWatcher, NodeEffects

if TYPE_CHECKING:
    from agora_worker.worker import Worker


def watcher_for(worker: Worker) -> InjectionWatcher:
    def corrupt() -> None:
        worker.pipeline.corrupt_next_gradient = True

    effects = NodeEffects(
        slow=worker.runtime.slowdown.set,
        corrupt_next_gradient=None if worker.role == StageRole.HEAD else corrupt,
    )
    return worker.member.injection_watcher(stage=worker.stage, points=worker.injections, effects=effects)
