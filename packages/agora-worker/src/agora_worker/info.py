"""``worker.info``: what a worker says about itself to operators, tools and tests."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from agora_core import world
from agora_worker import __version__
from agora_worker.serving.compute import transfer_info
from agora_worker.serving.device_metrics import device_memory_info

if TYPE_CHECKING:
    from agora_worker.worker import Worker


def worker_info(worker: Worker) -> dict:
    """The reply of ``worker.info`` (fields: the worker README's table)."""
    runtime = worker.runtime
    return {
        "node_id": worker.key.node_id,
        "stage": worker.stage,
        "role": worker.role,
        "step": worker.optimizer.step,
        "last_step": None if worker.last_step is None else dataclasses.asdict(worker.last_step),
        "samples": worker.optimizer.samples,
        "stage_samples": worker.progress.stage_samples,
        "ignored_step_claims": dict(worker.progress.ignored),  # peer -> its claim, past the quorum
        "queued": runtime.queued_samples,
        "processed": runtime.samples_processed,
        "compute_seconds": runtime.compute_seconds,
        "processed_by_op": dict(runtime.samples_by_op),
        "recent_batch_sizes": list(runtime.batch_sizes),
        "max_batch": worker.max_batch,
        "device": str(worker.device),
        # host <-> device transfers of the trained weights (None: one shared copy, a CPU worker)
        "transfers": transfer_info(worker.optimizer),
        "oom_splits": runtime.oom_splits,
        "optimizer_seconds": worker.optimizer.step_seconds,  # all steps' time on the compute thread
        "device_memory": device_memory_info(worker.device),  # allocated, reserved, peak, total bytes
        "phase": worker.phases.phase,
        "phase_steps_left": worker.phases.steps_left(worker.optimizer.step),
        "join": None if worker.joined is None else worker.joined.info(),
        # its first serving round held against its peers' distances (joiners only)
        "probation": {"pending": worker.probation.pending, "verdicts": worker.probation.verdicts},
        "steps_refused": worker.optimizer.refused_steps,
        "refused_while_invisible": worker.pipeline.refused_while_invisible,
        "averaging": worker.averager.info(),
        "checkpoint": None if worker.checkpoint_writer is None else worker.checkpoint_writer.info(),
        # serial, expires, refreshes, lost; None in an open run
        "credential": worker.admission.info(),
        "injections": worker.injection_watch.info(),  # armed, scheduled, obeyed record ids
        "version": __version__,
        "time": world.wall(),
    }
