"""Joining a live stage on real sockets: a newcomer downloads a replica's state (bit-exact,
from several donors, past a donor that dies or lies), then syncs before it serves; workers of
a fresh run serve at once from their own weights."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest

from agora_core.config import RunConfig, SurrogateConfig
from agora_core.config.lifecycle import JoinConfig, SyncConfig
from agora_core.config.run import DhtConfig, ModelConfig, OptimizerConfig
from agora_core.contract import Method, Phase
from agora_core.errors import BadRequest, NotServing
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_core.rpc.linkemu import LinkConfig
from agora_devkit.processes import wait_until_async
from agora_worker.joining import PhaseTracker, StateDownloadFailed, download_state
from agora_worker.joining.donor import manifest_payload
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
MODEL = ModelConfig(
    d_model=32, n_heads=2, mlp_ratio=2.0, subspace_rank=4, vocab_size=256, seq_len=8, stage_layers=(1, 1, 1)
)
SYNC = SyncConfig(weight_sync_steps=4, optimizer_sync_steps=2, stale_after_steps=3)
RUN = RunConfig(
    name="j", seed=5, model=MODEL, dht=DHT, sync=SYNC, optimizer=OptimizerConfig(target_batch_size=4)
)
# Surrogate stages with a 4 MiB untrained tensor: big enough to be cut into pieces.
BIG = dataclasses.replace(
    RUN,
    model=dataclasses.replace(MODEL, kind="surrogate", surrogate=SurrogateConfig(dummy_parameters=1 << 20)),
    join=JoinConfig(piece_bytes=64 * 1024, pieces_in_flight=2, piece_timeout_s=3.0),
)
FAST = WorkerSettings(
    device="cpu", max_batch_samples=16, progress_interval_s=0.05, announce_interval_s=0.2, shutdown_grace_s=5
)


async def capture(worker: Worker):
    return await asyncio.wrap_future(worker.runtime.call(worker.state.capture))


async def train_and_step(worker: Worker, client: RpcClient, steps: int, *, data_seed: int = 0) -> None:
    """One real backward (so AdamW has moments), then ``steps`` steps of the stage."""
    rng = np.random.default_rng(data_seed)
    tokens = rng.integers(0, 256, (2, 8), dtype=np.int64)
    grad = rng.standard_normal((2, 8, 4)).astype(np.float32)
    await client.call(worker.address, Method.BACKWARD, {"stage": 0}, {"tokens": tokens, "grad": grad})
    for _ in range(steps):
        await worker.take_step()
    assert worker.last_step is not None


async def test_workers_of_a_fresh_run_serve_from_their_own_weights(workers):
    first, second = await workers(0), await workers(0)
    for worker in (first, second):
        assert worker.joined.source == "initial" and worker.joined.step == 0
        assert worker.phases.phase is Phase.SERVING


async def test_a_newcomer_downloads_a_replica_bit_exact_and_syncs_before_it_serves(workers, client):
    donor = await workers(0)
    await train_and_step(donor, client, steps=SYNC.stale_after_steps + 3)
    # a joiner learns the donors' steps from their stored reports (at most one a second)
    await wait_until_async(
        lambda: (donor.progress.reported or (-1,))[0] == donor.optimizer.step, what="donor progress"
    )
    newcomer = await workers(0)
    assert newcomer.joined.source == "peers" and newcomer.joined.donors == [donor.key.node_id]
    assert newcomer.joined.verified
    assert newcomer.optimizer.step == donor.optimizer.step
    mine, theirs = await capture(newcomer), await capture(donor)
    assert any(name.startswith("adam/") for name in theirs.tensors)  # moments travelled too
    assert mine.digests() == theirs.digests()  # weights and moments bit-exact
    # Weight sync: invisible and refusing batches, until the stage took its steps.
    assert newcomer.phases.phase is Phase.WEIGHT_SYNC
    with pytest.raises(NotServing):
        await client.call(
            newcomer.address, Method.FORWARD, {"stage": 0}, {"tokens": np.zeros((1, 8), np.int64)}
        )
    for _ in range(SYNC.weight_sync_steps):
        await donor.take_step()
    await wait_until_async(lambda: newcomer.phases.phase is Phase.OPTIMIZER_SYNC, what="optimizer sync")
    reply = await client.call(
        newcomer.address, Method.FORWARD, {"stage": 0}, {"tokens": np.zeros((1, 8), np.int64)}
    )
    assert reply.tensors["boundary"].shape == (1, 8, 4)
    for _ in range(SYNC.optimizer_sync_steps):
        await donor.take_step()
    await wait_until_async(lambda: newcomer.phases.phase is Phase.SERVING, what="serving")


async def test_a_worker_that_falls_far_behind_its_stage_resyncs(workers):
    laggard, leader = await workers(0), await workers(0)
    assert laggard.phases.phase is Phase.SERVING
    stalled = threading.Event()  # the laggard's compute thread hangs: it cannot step
    laggard.runtime.call(stalled.wait)
    for _ in range(2 * SYNC.stale_after_steps + 2):  # far enough ahead whatever it read last
        await leader.take_step()
    stalled.set()
    await wait_until_async(lambda: laggard.optimizer.step == leader.optimizer.step, what="catching up")
    assert laggard.phases.phase is Phase.WEIGHT_SYNC and laggard.phases.since_step == leader.optimizer.step
    assert leader.phases.phase is Phase.SERVING


async def test_a_download_spreads_over_donors_and_survives_one_dying(workers, client):
    first = await workers(1, BIG, link=LinkConfig(up_bits_per_s=40e6))
    reference = await capture(first)
    others = []
    for _ in range(2):  # the same state on every donor: any of them may serve any piece
        donor = await workers(1, BIG, link=LinkConfig(up_bits_per_s=40e6))
        await asyncio.wrap_future(donor.runtime.call(lambda d=donor: d.state.install(reference)))
        others.append(donor)
    donors = [first, *others]
    expected = first.state.expected_specs()
    required = {s.name for s in first.state.param_specs()}
    task = asyncio.get_running_loop().create_task(
        download_state(
            client, [d.address for d in donors], expected=expected, required=required, config=BIG.join
        )
    )
    served = lambda d: d.metrics.sample_value("agora_state_served_bytes_total") or 0  # noqa: E731
    await wait_until_async(lambda: served(others[0]) > 0, what="the first donor's bytes")
    # Donors keep serving batches while they serve their state.
    boundary = np.zeros((1, 8, 4), np.float32)
    reply = await client.call(
        first.address,
        Method.FORWARD,
        {"stage": 1},
        {"tokens": np.zeros((1, 8), np.int64), "boundary": boundary},
    )
    assert reply.tensors["boundary"].shape == (1, 8, 4) and not task.done()
    await others[0].stop(grace_s=0)  # gone mid-transfer
    snapshot, download = await task
    assert snapshot.digests() == reference.digests()
    by_donor = {d.address: d.fetched_bytes for d in download.donors}
    assert all(by_donor[d.address] > 0 for d in donors)
    assert download.failed_pieces > 0
    assert sum(by_donor.values()) == download.total_bytes  # nothing that arrived was fetched again


async def test_each_weights_adamw_state_comes_whole_from_one_replica(workers, client):
    # Two replicas trained on different samples: their weights and moments differ. The
    # download still spreads over both, but a weight's exp_avg, exp_avg_sq and step come from
    # the same one: one replica's first moment over the other's second is no AdamW state.
    first, second = await workers(0), await workers(0)
    await train_and_step(first, client, steps=1, data_seed=1)
    await train_and_step(second, client, steps=1, data_seed=2)
    states = [await capture(first), await capture(second)]
    snapshot, download = await download_state(
        client, [first.address, second.address], expected=first.state.expected_specs(), config=RUN.join
    )
    bundles = {name.rsplit("/", 1)[0] for name in snapshot.tensors if name.startswith("adam/")}
    assert bundles, "the donors' moments travelled"
    sources = set()
    for bundle in bundles:
        names = [f"{bundle}/{field}" for field in ("exp_avg", "exp_avg_sq", "step")]
        mine = [snapshot.digest(n) for n in names]
        owners = [i for i, state in enumerate(states) if [state.digest(n) for n in names] == mine]
        assert owners, f"{bundle}: its moments mix the two replicas"
        sources.update(owners)
    assert sources == {0, 1}  # the bundles were spread over both donors
    assert all(d.fetched_bytes > 0 for d in download.donors)


async def test_a_lying_donor_is_caught_by_the_digest_and_its_tensor_refetched(workers, client):
    honest = await workers(1, BIG)
    truth = await capture(honest)
    liar = RpcServer(listen="127.0.0.1:0")

    async def manifest(request):
        return manifest_payload("lie", "liar", truth)

    async def fetch(request):
        data = truth.tensors[request.meta["name"]].reshape(-1).view(np.uint8)
        start = request.meta["offset"]
        piece = data[start : start + request.meta["length"]].copy()
        piece[0] ^= 1
        return Payload({"offset": start}, {"data": piece})

    liar.register(Method.STATE_MANIFEST, manifest)
    liar.register(Method.STATE_FETCH, fetch)
    await liar.start()
    try:
        expected = honest.state.expected_specs()
        snapshot, download = await download_state(
            client, [liar.address, honest.address], expected=expected, config=BIG.join
        )
        assert snapshot.digests() == truth.digests()
        assert download.refetched_tensors >= 1
        # The liar alone cannot deliver a verified state.
        with pytest.raises(StateDownloadFailed):
            await download_state(client, [liar.address], expected=expected, config=BIG.join)
    finally:
        await liar.stop()


async def test_a_donor_refuses_fetches_outside_its_snapshot(workers, client):
    donor = await workers(1, BIG)
    manifest = await client.call(donor.address, Method.STATE_MANIFEST)
    snapshot, name = manifest.meta["snapshot"], manifest.meta["tensors"][0][0]
    for meta in (
        {"snapshot": "nope", "name": name, "offset": 0, "length": 8},
        {"snapshot": snapshot, "name": "param/none", "offset": 0, "length": 8},
        {"snapshot": snapshot, "name": name, "offset": -1, "length": 8},
        {"snapshot": snapshot, "name": name, "offset": 0, "length": BIG.join.piece_bytes + 1},
    ):
        with pytest.raises(BadRequest):
            await client.call(donor.address, Method.STATE_FETCH, meta)
    assert (await client.call(donor.address, Method.WORKER_INFO)).meta["stage"] == 1  # still serving


def test_sync_phases_run_their_steps_then_serve_and_a_lagging_worker_resyncs():
    changes: list[Phase] = []
    phases = PhaseTracker(SYNC, on_change=changes.append)
    assert phases.phase is Phase.SERVING  # a worker on its own state serves at once
    phases.start_sync(10, reason="downloaded")
    assert phases.phase is Phase.WEIGHT_SYNC and phases.steps_left(10) == SYNC.weight_sync_steps
    phases.advance(10 + SYNC.weight_sync_steps - 1, stage_step=10 + SYNC.weight_sync_steps - 1)
    assert phases.phase is Phase.WEIGHT_SYNC
    step = 10 + SYNC.weight_sync_steps
    phases.advance(step, stage_step=step)
    assert phases.phase is Phase.OPTIMIZER_SYNC
    phases.advance(step + SYNC.optimizer_sync_steps, stage_step=step + SYNC.optimizer_sync_steps)
    assert phases.phase is Phase.SERVING
    step += SYNC.optimizer_sync_steps
    phases.advance(step, stage_step=step + SYNC.stale_after_steps)  # behind, but not too far
    assert phases.phase is Phase.SERVING
    phases.advance(step, stage_step=step + SYNC.stale_after_steps + 1)
    assert phases.phase is Phase.WEIGHT_SYNC and phases.since_step == step + SYNC.stale_after_steps + 1
    assert changes == [Phase.WEIGHT_SYNC, Phase.OPTIMIZER_SYNC, Phase.SERVING, Phase.WEIGHT_SYNC]


def test_an_operator_override_pins_the_phase():
    phases = PhaseTracker(SYNC, override=Phase.OPTIMIZER_SYNC)
    phases.start_sync(0, reason="downloaded")
    phases.advance(100, stage_step=200)
    assert phases.phase is Phase.OPTIMIZER_SYNC and phases.steps_left(100) is None


def test_phases_of_zero_steps_are_skipped():
    phases = PhaseTracker(SyncConfig(weight_sync_steps=0, optimizer_sync_steps=0))
    phases.start_sync(7, reason="downloaded")
    assert phases.phase is Phase.SERVING


async def test_a_weights_only_download_leaves_the_optimizer_state_on_the_donor(workers, client):
    donor = await workers(0)
    await train_and_step(donor, client, steps=1)
    weights = {s.name: s for s in donor.state.param_specs()}
    snapshot, _ = await download_state(client, [donor.address], expected=weights, config=RUN.join)
    assert set(snapshot.tensors) == set(weights)
    light = await client.call(donor.address, Method.STATE_MANIFEST, {"weights_only": True})
    assert {name for name, _, _ in light.meta["tensors"]} == set(weights)  # no moments copied
    full = await client.call(donor.address, Method.STATE_MANIFEST)
    assert any(name.startswith("adam/") for name, _, _ in full.meta["tensors"])


async def test_a_joiner_in_optimizer_sync_warms_its_moments_and_leaves_its_weights(workers, client):
    worker = await workers(0, phase=Phase.OPTIMIZER_SYNC)  # pinned there, as an operator may
    await train_and_step(worker, client, steps=1)
    before = await capture(worker)
    assert worker.last_step.warmup and worker.last_step.applied and worker.last_step.samples == 2
    await train_and_step(worker, client, steps=1, data_seed=3)
    after = await capture(worker)
    weights = [n for n in after.tensors if n.startswith("param/")]
    moments = [n for n in after.tensors if n.endswith("/exp_avg_sq")]
    assert weights and all(after.digest(n) == before.digest(n) for n in weights)
    assert moments and any(after.digest(n) != before.digest(n) for n in moments)


async def test_a_step_the_guard_refuses_sends_the_worker_back_to_weight_sync(workers, client):
    worker = await workers(0)
    await train_and_step(worker, client, steps=1, data_seed=1)

    def lose_second_moments():  # e.g. moments put together from two replicas' halves
        for state in worker.optimizer.adamw.state.values():
            state["exp_avg_sq"].mul_(1e-12)

    await asyncio.wrap_future(worker.runtime.call(lose_second_moments))
    before = await capture(worker)
    await train_and_step(worker, client, steps=1, data_seed=2)  # other tokens: rows with m, no g
    report = worker.last_step
    assert report.refused and not report.applied
    assert worker.phases.phase is Phase.WEIGHT_SYNC and worker.phases.since_step == report.step
    assert worker.metrics.sample_value("agora_worker_resyncs_total", {"cause": "step_refused"}) == 1
    after = await capture(worker)
    assert all(after.digest(n) == before.digest(n) for n in after.tensors if not n.endswith("/step"))


async def test_rounds_averaged_while_serving_make_the_checkpoints_standing(workers, client, tmp_path):
    # What the export weighs: a checkpoint written after a round averaged while serving.
    first, second = await workers(0, checkpoint_dir=str(tmp_path / "a")), await workers(0)
    standing = first.checkpoint_writer._standing
    assert standing() == {"phase": "serving", "serving_rounds": 0}
    await asyncio.gather(
        *(client.call(w.address, Method.AVERAGING_START, {"round": 0}, timeout_s=30) for w in (first, second))
    )
    assert first.averager.reports[-1].group_size == 2
    assert standing() == {"phase": "serving", "serving_rounds": 1}
    first.phases.start_sync(first.optimizer.step, reason="test")
    assert standing()["serving_rounds"] == 0 and standing()["phase"] == "weight_sync"
