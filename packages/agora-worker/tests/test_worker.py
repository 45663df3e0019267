"""Workers on real sockets: serving a pipeline, rejecting bad requests, stepping together,
announcing and withdrawing themselves in the DHT."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time

import numpy as np
import pytest
import torch

from agora_core.config import RunConfig, SurrogateConfig
from agora_core.config.run import DhtConfig, ModelConfig, OptimizerConfig
from agora_core.errors import BadRequest, StageMismatch
from agora_core.schema import WorkerAnnouncement, stage_workers_key
from agora_devkit.processes import spawn_python, wait_until_async
from agora_devkit.runs import tiny_run_toml
from agora_devkit.worker import train_one_pass
from agora_worker.model import build_stage
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
MODEL = ModelConfig(
    d_model=32, n_heads=2, mlp_ratio=2.0, subspace_rank=4, vocab_size=256, seq_len=8, stage_layers=(1, 1, 1)
)
RUN = RunConfig(name="t", seed=3, model=MODEL, dht=DHT, optimizer=OptimizerConfig(target_batch_size=8))
FAST = WorkerSettings(
    device="cpu", max_batch_samples=16, progress_interval_s=0.05, announce_interval_s=0.2, shutdown_grace_s=5
)


def sample(b: int = 1, t: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (b, t), dtype=np.int64), rng.integers(0, 256, (b, t), dtype=np.int64)


async def test_a_pipeline_of_workers_trains_one_sample_like_the_local_modules(workers, client):
    pipeline = [await workers(s) for s in range(3)]
    reference = [build_stage(RUN, s) for s in range(3)]  # the same initial weights
    tokens, labels = sample(b=2)
    trained = await train_one_pass(client, [w.address for w in pipeline], tokens, labels)
    body, tail = trained.body, trained.tail
    evaluated = await client.call(  # no step yet: the weights the pass trained on
        pipeline[2].address,
        "forward",
        {"stage": 2},
        {"tokens": tokens, "boundary": body.tensors["boundary"], "labels": labels},
    )
    # the tail's forward_backward is its forward plus its backward, in one request
    t = torch.from_numpy(tokens)
    x = torch.from_numpy(np.array(body.tensors["boundary"])).requires_grad_(True)
    losses = reference[2](t, x, torch.from_numpy(labels))
    losses.sum().backward()
    np.testing.assert_allclose(tail.tensors["loss"], losses.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(evaluated.tensors["loss"], tail.tensors["loss"], rtol=1e-6)
    np.testing.assert_allclose(tail.tensors["grad"], x.grad.numpy(), rtol=1e-4, atol=1e-8)
    assert trained.back.tensors["grad"].shape == (2, 8, MODEL.subspace_rank)
    assert trained.done.tensors == {}  # the head's backward returns nothing
    infos = [(await client.call(w.address, "worker.info")).meta for w in pipeline]
    assert [i["samples"] for i in infos] == [2, 2, 2]  # each stage counted the samples it trained


async def test_bad_requests_get_clear_errors_and_the_worker_keeps_serving(workers, client):
    body = await workers(1)
    tokens, _ = sample()
    boundary = np.zeros((1, 8, MODEL.subspace_rank), dtype=np.float32)
    cases = [
        (
            StageMismatch,
            "stage 2 reached a worker of stage 1",
            {"stage": 2},
            {"tokens": tokens, "boundary": boundary},
        ),
        (BadRequest, "shape", {"stage": 1}, {"tokens": tokens, "boundary": boundary[:, :, :2]}),
        (BadRequest, "float32", {"stage": 1}, {"tokens": tokens, "boundary": boundary.astype(np.int32)}),
        (
            BadRequest,
            "int32 or int64",
            {"stage": 1},
            {"tokens": tokens.astype(np.float32), "boundary": boundary},
        ),
        (BadRequest, "outside", {"stage": 1}, {"tokens": tokens + 1000, "boundary": boundary}),
        (BadRequest, "NaN", {"stage": 1}, {"tokens": tokens, "boundary": boundary + np.nan}),
        (BadRequest, "missing tensor 'boundary'", {"stage": 1}, {"tokens": tokens}),
        (
            BadRequest,
            "shape",
            {"stage": 1},
            {"tokens": np.zeros((1, 99), dtype=np.int64), "boundary": boundary},
        ),
    ]
    for error, message, meta, tensors in cases:
        with pytest.raises(error, match=message):
            await client.call(body.address, "forward", meta, tensors)
    with pytest.raises(BadRequest, match="served by the tail"):
        await client.call(
            body.address, "forward_backward", {"stage": 1}, {"tokens": tokens, "boundary": boundary}
        )
    ok = await client.call(body.address, "forward", {"stage": 1}, {"tokens": tokens, "boundary": boundary})
    assert ok.tensors["boundary"].shape == (1, 8, MODEL.subspace_rank)


async def test_concurrent_single_sample_requests_are_coalesced(workers, client):
    head = await workers(0)
    calls = [
        client.call(head.address, "forward", {"stage": 0}, {"tokens": sample(seed=i)[0]}) for i in range(32)
    ]
    replies = await asyncio.gather(*calls)
    assert all(r.tensors["boundary"].shape == (1, 8, MODEL.subspace_rank) for r in replies)
    info = (await client.call(head.address, "worker.info")).meta
    assert max(info["recent_batch_sizes"]) > 1


SURROGATE = dataclasses.replace(
    RUN, model=dataclasses.replace(MODEL, kind="surrogate", surrogate=SurrogateConfig())
)


async def test_two_workers_of_a_stage_step_together_when_their_count_reaches_the_target(workers, client):
    a, b = await workers(1, SURROGATE), await workers(1, SURROGATE)
    boundary = np.zeros((1, 8, MODEL.subspace_rank), dtype=np.float32)

    async def train(worker: Worker, samples: int, offset: int) -> None:
        for i in range(samples):
            tokens, _ = sample(seed=offset + i)
            await client.call(
                worker.address,
                "backward",
                {"stage": 1},
                {"tokens": tokens, "boundary": boundary, "grad": boundary + 1},
            )

    await wait_until_async(
        lambda: len(a.progress.known()) == 1 and len(b.progress.known()) == 1, what="each to know the other"
    )
    collector = min((a, b), key=lambda w: w.key.node_id)  # the counts go to the lower node id
    await train(a, 5, 0)
    await train(b, 2, 100)  # 7 of 8: nobody steps yet
    await wait_until_async(lambda: collector.progress.stage_samples == 7, what="the collector to see 7")
    assert a.optimizer.step == b.optimizer.step == 0
    await train(b, 1, 200)  # the 8th sample: the stage holds a batch
    # each step's report: the optimizer steps on the compute thread before the worker's loop
    # takes its report, so its step count alone may be ahead of it
    await wait_until_async(
        lambda: all(w.last_step is not None and w.last_step.step == 1 for w in (a, b)),
        what="both to step",
        timeout_s=10,
    )
    assert a.optimizer.step == b.optimizer.step == 1
    assert a.last_step.samples == 5 and b.last_step.samples == 3
    assert a.last_step.applied and b.last_step.applied


async def test_the_collector_learns_each_count_from_pushes_while_reports_are_stored_at_most_once_a_second(
    workers, client
):
    run = dataclasses.replace(SURROGATE, optimizer=OptimizerConfig(target_batch_size=64))  # no step here
    a, b = await workers(1, run), await workers(1, run)
    await wait_until_async(
        lambda: len(a.progress.known()) == 1 and len(b.progress.known()) == 1, what="each to know the other"
    )
    collector, sender = sorted((a, b), key=lambda w: w.key.node_id)
    assert sender.progress.collector() == collector.address and collector.progress.collector() is None
    boundary = np.zeros((1, 8, MODEL.subspace_rank), dtype=np.float32)
    stored, since = sender.progress.publishes, time.monotonic()
    samples = 12
    for i in range(samples):
        tokens, _ = sample(seed=i)
        for worker in (sender, collector):  # each holds i + 1: the collector counts 2 (i + 1)
            await client.call(
                worker.address,
                "backward",
                {"stage": 1},
                {"tokens": tokens, "boundary": boundary, "grad": boundary + 1},
            )
        held = 2 * (i + 1)
        await wait_until_async(
            lambda n=held: collector.progress.stage_samples == n, what=f"the collector to see {held}"
        )
    stores = sender.progress.publishes - stored
    # the collector saw each of the 12 counts, which the sender stored at most once a second:
    # pushes carried them; the collector pushed none of its own (nobody decides on them)
    assert stores <= (time.monotonic() - since) / 1.0 + 1
    assert stores < samples and sender.progress.pushes_sent >= samples - stores
    assert collector.progress.pushes_sent == 0


async def test_a_bad_or_unknown_progress_push_is_refused_or_ignored_and_the_worker_keeps_counting(
    workers, client
):
    a, b = await workers(1, SURROGATE), await workers(1, SURROGATE)
    await wait_until_async(lambda: len(b.progress.known()) == 1, what="b to know a")
    for meta in (
        {"stage": 1, "node": a.key.node_id, "step": -1, "samples": 3},
        {"stage": 1, "step": 0, "samples": "3"},
    ):
        with pytest.raises(BadRequest):
            await client.call(b.address, "progress.poke", meta)
    # a node no signed report shows (a made-up id): not counted toward the stage's batch
    await client.call(b.address, "progress.poke", {"stage": 1, "node": "ab" * 32, "step": 0, "samples": 7})
    await client.call(
        b.address, "progress.poke", {"stage": 1, "node": a.key.node_id, "step": 0, "samples": 7}
    )
    await wait_until_async(lambda: b.progress.stage_samples == 7, what="b to count a's pushed 7")
    assert [r.node_id for r in b.progress.known()] == [a.key.node_id]
    assert b.optimizer.step == 0  # 7 of 8: nobody steps


async def test_an_idle_worker_reports_only_when_its_refresh_is_due_and_at_once_on_its_first_sample(
    workers, client
):
    averaging = dataclasses.replace(SURROGATE.averaging, matchmaking_window_s=2.0)  # within the ttl
    run = dataclasses.replace(SURROGATE, dht=dataclasses.replace(DHT, record_ttl_s=6.0), averaging=averaging)
    worker = await workers(1, run)  # progress interval 0.05 s; a report lives 6 s: refresh 2 s
    refresh_s = run.dht.record_ttl_s / 3
    await wait_until_async(lambda: worker.progress.publishes >= 1, what="the first report")
    first, since = worker.progress.publishes, time.monotonic()
    await wait_until_async(lambda: worker.progress.publishes >= first + 2, what="two refreshes", timeout_s=15)
    # nothing changed: two refreshes, a refresh period apart -- not a report every 0.05 s tick
    assert time.monotonic() - since >= refresh_s
    assert worker.progress.reported == (0, 0)
    boundary = np.zeros((1, 8, MODEL.subspace_rank), dtype=np.float32)
    tokens, _ = sample()
    landed = time.monotonic()
    await client.call(
        worker.address,
        "backward",
        {"stage": 1},
        {"tokens": tokens, "boundary": boundary, "grad": boundary + 1},
    )
    # the first sample wakes the idle worker: its report says so well before the next refresh
    await wait_until_async(lambda: worker.progress.reported == (0, 1), what="the sample reported")
    assert time.monotonic() - landed < refresh_s


async def test_announcement_appears_and_is_withdrawn_on_clean_shutdown(workers, seed):
    worker = await workers(2)
    key = stage_workers_key(RUN.name, 2)
    found = await seed.get(key)
    entry = next(iter(found.values()))
    announcement = WorkerAnnouncement.from_value(entry.value)
    assert announcement.address == worker.address and announcement.phase == "serving"
    # it lives the run's record_ttl_s (60 s), not a few announce intervals (0.2 s here)
    assert RUN.dht.record_ttl_s - 5 < entry.expiration - time.time() <= RUN.dht.record_ttl_s
    assert announcement.stage == 2 and announcement.max_batch == 16
    await worker.stop(grace_s=1)
    assert await seed.get(key) == {}  # withdrawn at once, not left to expire


def test_worker_cli_serves_and_stops_cleanly_on_sigterm(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(tiny_run_toml("cli", stages=2))
    command = [
        "-m",
        "agora_worker",
        "run",
        "--config",
        str(config),
        "--stage",
        "0",
        "--key-file",
        str(tmp_path / "k"),
        "--device",
        "cpu",
        "--log-format",
        "json",
    ]
    with spawn_python(command) as child:
        address = child.read_until("  serving    ")
        assert address.startswith("tcp://127.0.0.1:")
        child.proc.send_signal(signal.SIGTERM)
        code = child.proc.wait(timeout=20)
        assert code == 0  # a clean exit: withdrew, left the DHT, drained, stopped
