"""The whole system through churn: a local swarm (`tools/swarm.py up`) loses a worker and
gains one, and loses every replica of a stage, and trains every sample once regardless.

Every node is its own OS process on 127.0.0.1, started and stopped by the same commands a user
runs (`swarm.py kill-worker`, `add-worker`, `restart-worker`); the authorizer pins a worker that
is added or restarted to its stage. What the nodes did is read while they run, the way an
operator's tools read it: a worker's state over its RPC, checkpoints on disk.
"""

from __future__ import annotations

import numpy as np
import pytest

from agora_devkit.swarm import (
    ADD_S,
    KILL_S,
    LEARNED_NATS,
    MARGIN_S,
    RUN_S,
    SAMPLES,
    first_samples,
    process_running,
)
from agora_worker.state.checkpoint import CheckpointStore, find_manifests

pytestmark = pytest.mark.slow


@pytest.mark.timeout(RUN_S + KILL_S + ADD_S + MARGIN_S, func_only=True)
def test_the_swarm_keeps_training_through_a_departure_and_an_arrival(
    swarm_config, swarm_shards, swarm_factory
):
    swarm = swarm_factory(swarm_config, swarm_shards, SAMPLES)
    stage_1 = swarm.placed()[1]
    status = swarm.command("status", timeout_s=KILL_S)
    assert "  authorizer tcp://127.0.0.1:" in status, status
    assert "(workers per stage 0: 2, 1: 2, 2: 2)" in status, status  # the authorizer's own count
    # Early departure and arrival: the newcomer's download, weight sync and optimizer sync must
    # all fit in the run's samples however fast this machine runs them (a quiet one did 1024
    # samples before a newcomer that arrived after 350 finished its sync).
    swarm.while_running(lambda: len(swarm.losses()) >= 120, what="120 samples")
    assert f"killed {stage_1[-1]} (stage 1" in swarm.command("kill-worker", "1", timeout_s=KILL_S)
    at_kill = len(swarm.losses())
    swarm.while_running(lambda: len(swarm.losses()) >= at_kill + 80, what="training on one stage-1 worker")
    added = swarm.command("add-worker", "1", timeout_s=ADD_S)  # pinned to stage 1 by the authorizer
    newcomer = f"worker-{2 * swarm.run.model.n_stages}"
    assert f"added {newcomer} on stage 1" in added, added
    # The arrival downloads the stage's state (it is more than stale_after_steps behind), is
    # invisible to the trainer through weight sync, then trains on samples and steps with the
    # stage: once it has run backwards, a later step of its own applies a gradient.
    trained_at: list[int] = []
    phases: list[str] = []
    visible_at: list[int] = []  # samples completed when it first became visible

    def newcomer_stepped_with_samples() -> bool:
        info = swarm.worker_info(newcomer)
        if info is None:
            return False
        assert info["stage"] == 1 and info["credential"]["valid"], info
        if not phases or phases[-1] != info["phase"]:
            phases.append(info["phase"])
        if not visible_at and info["phase"] in ("optimizer_sync", "serving"):
            visible_at.append(len(swarm.losses()))
        if info["phase"] == "weight_sync":
            assert sum(info["processed_by_op"].values()) == 0, "it served batches in weight sync"
        if not trained_at and info["processed_by_op"].get("backward", 0) > 0:
            trained_at.append(info["step"])
        last = info["last_step"]
        done = bool(trained_at) and last is not None and last["applied"] and last["step"] > trained_at[0]
        if done:
            joined = info["join"]  # its installed state read back equalled the donors' bytes
            assert joined["source"] == "peers" and joined["donors"] and joined["verified"], joined
            assert info["refused_while_invisible"] == 0, "a trainer routed to it while it was invisible"
        return done

    swarm.while_running(newcomer_stepped_with_samples, what="the newcomer to step with samples it trained")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    losses = swarm.losses()
    order = first_samples(swarm_shards, swarm.run, SAMPLES)
    assert sorted(losses) == sorted(order), output  # nothing lost to the departure
    curve = np.array([losses[i] for i in order])
    assert curve[-128:].mean() < curve[:64].mean() - LEARNED_NATS  # it kept learning
    assert phases[0] in ("downloading", "weight_sync") and "weight_sync" in phases, phases
    # No spike when it joins: the samples after it became visible fare no worse than those before.
    at = visible_at[0]
    before, after = curve[max(0, at - 64) : at].mean(), curve[at : at + 64].mean()
    assert after < 1.1 * before, f"loss {before:.3f} before it joined, {after:.3f} after"
    assert not [m["pid"] for m in swarm.members() if process_running(m["pid"])], (
        "the swarm left processes behind"
    )


@pytest.mark.timeout(RUN_S + 2 * KILL_S + ADD_S + MARGIN_S, func_only=True)
def test_a_stage_whose_every_replica_died_resumes_from_a_checkpoint(
    swarm_config, swarm_shards, swarm_factory
):
    samples = SAMPLES // 2  # the outage comes at about a third of them; the rest is for the comeback
    swarm = swarm_factory(swarm_config, swarm_shards, samples)
    first, last = swarm.placed()[1]  # kill-worker takes the last started first
    directory = swarm.run_dir / "checkpoints" / last

    def checkpointed() -> int:
        return max((m.step for m in find_manifests(directory)), default=0) if directory.exists() else 0

    swarm.while_running(lambda: checkpointed() >= 10, what="a checkpoint of stage 1 at step 10 or later")
    for victim in (last, first):  # every replica of stage 1
        assert f"killed {victim}" in swarm.command("kill-worker", "1", timeout_s=KILL_S)
    saved = CheckpointStore(directory, run=swarm.run, stage=1, keep=swarm.run.checkpoint.keep).newest_valid()
    assert saved is not None and saved.step >= 10

    # The dead replicas' progress reports, ahead of the checkpoint, outlive them in the DHT for
    # their TTL; the restarted worker counts only live members' reports, so it does not step
    # to catch up with them.
    output = swarm.command("restart-worker", last, timeout_s=ADD_S)  # pinned back to stage 1
    assert f"resumed from step {saved.step}" in output, output
    info = swarm.worker_info(last)
    assert info is not None and info["checkpoint"]["resumed_step"] == saved.step
    assert info["join"]["source"] == "checkpoint" and saved.step <= info["step"] < saved.step + 5, info

    def stepped_on_from_the_checkpoint() -> bool:
        info = swarm.worker_info(last)
        step = None if info is None else info["last_step"]
        return step is not None and step["applied"] and step["step"] > saved.step

    swarm.while_running(stepped_on_from_the_checkpoint, what="the resumed worker to train on")
    output = swarm.wait_done()
    assert swarm.proc.returncode == 0, output
    expected = sorted(first_samples(swarm_shards, swarm.run, samples))
    assert sorted(swarm.losses()) == expected, output  # the stage's outage lost no sample
