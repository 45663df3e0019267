"""The sync phases a joining worker passes through, counted in its stage's steps.

downloading -> weight_sync (``sync.weight_sync_steps``) -> optimizer_sync
(``sync.optimizer_sync_steps``) -> serving. A worker that started from its own state (a
fresh run, or a checkpoint no live replica is ahead of) serves at once. A serving or
optimizer-syncing worker whose stage gets more than ``sync.stale_after_steps`` ahead of it
goes back to weight sync. An operator's override (``--phase``) pins one phase for good.
"""

from __future__ import annotations

from collections.abc import Callable

from agora_core.config.lifecycle import SyncConfig
from agora_core.contract import Phase
from agora_core.observability.logs import get_logger

log = get_logger("worker.phases")


class PhaseTracker:
    def __init__(
        self,
        config: SyncConfig,
        *,
        override: Phase | None = None,
        on_change: Callable[[Phase], None] | None = None,
    ):
        self.config = config
        self.override = override
        self.phase: Phase = override or Phase.SERVING
        self.since_step = 0  # the step this phase began at
        self._on_change = on_change

    def enter(self, phase: Phase, step: int, *, reason: str) -> None:
        if self.override is not None or phase is self.phase:
            return
        log.info("phase_changed", previous=self.phase, phase=phase, step=step, reason=reason)
        self.phase, self.since_step = phase, step
        if self._on_change is not None:
            self._on_change(phase)

    def start_sync(self, step: int, *, reason: str) -> None:
        """Begin weight sync at ``step`` (or skip straight to the later phases when they last 0 steps)."""
        self.enter(Phase.WEIGHT_SYNC, step, reason=reason)
        self.advance(step, stage_step=step)

    def advance(self, step: int, *, stage_step: int) -> None:
        """The worker is at ``step`` and the furthest replica of its stage at ``stage_step``."""
        config = self.config
        if (
            self.phase in (Phase.SERVING, Phase.OPTIMIZER_SYNC)
            and stage_step - step > config.stale_after_steps
        ):
            self.enter(Phase.WEIGHT_SYNC, stage_step, reason=f"{stage_step - step} steps behind its stage")
            return
        if self.phase is Phase.WEIGHT_SYNC and step - self.since_step >= config.weight_sync_steps:
            self.enter(Phase.OPTIMIZER_SYNC, step, reason="weight sync done")
        if self.phase is Phase.OPTIMIZER_SYNC and step - self.since_step >= config.optimizer_sync_steps:
            self.enter(Phase.SERVING, step, reason="optimizer sync done")

    def steps_left(self, step: int) -> int | None:
        """Stage steps until this phase ends (None: it does not end by itself)."""
        length = {
            Phase.WEIGHT_SYNC: self.config.weight_sync_steps,
            Phase.OPTIMIZER_SYNC: self.config.optimizer_sync_steps,
        }
        if self.override is not None or self.phase not in length:
            return None
        return max(0, self.since_step + length[self.phase] - step)
