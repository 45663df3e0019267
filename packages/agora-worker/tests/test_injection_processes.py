"""The mechanism benchmarks/preemption.py relies on, against a real worker process: a record in
the DHT makes a sender exit mid averaging send, as a crash would, and the survivor still
averages what it can.

The victim is ``agora-worker run`` started by this test (stopped even on failure); the survivor
is an in-process worker of the same stage; the operator writes through the seed.
"""

from __future__ import annotations

import asyncio

import pytest

from agora_core.config import OperatorConfig, RunConfig, SurrogateConfig
from agora_core.config.dump import dump_toml
from agora_core.config.run import AveragingConfig, DhtConfig, ModelConfig, TransportConfig
from agora_core.contract import Method
from agora_core.identity import NodeKey
from agora_core.injection import INJECTED_EXIT_CODE, Targets
from agora_core.injection.publish import new_injection, publish
from agora_devkit.processes import poll_until, spawn_python, wait_until_async
from agora_worker.averaging.allreduce import slice_bounds
from agora_worker.averaging.reducer import chunk_bounds
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

pytestmark = pytest.mark.slow
OPERATOR = NodeKey.generate()
DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=2.0, op_timeout_s=2.0)
RUN = RunConfig(
    name="inject-processes",
    model=ModelConfig(
        kind="surrogate",
        d_model=32,
        n_heads=2,
        subspace_rank=4,
        vocab_size=256,
        seq_len=8,
        stage_layers=(1, 1),
        surrogate=SurrogateConfig(dummy_parameters=100_000),  # ~50 chunks of 4 KiB per slice
    ),
    dht=DHT,
    averaging=AveragingConfig(
        segments=1, cadence_steps=100_000, matchmaking_window_s=3.0, round_timeout_s=20.0, chunk_timeout_s=1.0
    ),
    transport=TransportConfig(chunk_bytes=4096),
    operator=OperatorConfig(public_keys=[OPERATOR.public_key.hex()], injection_watch_s=0.1),
)
FAST = WorkerSettings(
    device="cpu", max_batch_samples=16, progress_interval_s=0.05, announce_interval_s=0.2, shutdown_grace_s=5
)


async def test_a_sender_told_to_exit_mid_averaging_send_dies_at_once_and_the_survivor_averages(
    seed, client, tmp_path
):
    config = tmp_path / "run.toml"
    config.write_text(dump_toml(RUN))
    victim_key = NodeKey.generate()
    command = ["-m", "agora_worker", "run", "--config", str(config), "--stage", "1", "--device", "cpu"]
    command += ["--bootstrap", seed.address, "--key-file", str(victim_key.save(tmp_path / "victim.key"))]
    command += ["--progress-interval", "0.05", "--announce-interval", "0.2"]
    survivor = Worker(run=RUN, stage=1, key=NodeKey.generate(), bootstrap=[seed.address], settings=FAST)
    with spawn_python(command, env={"AGORA_LOG_LEVEL": "warning"}) as victim:
        await survivor.start()
        try:
            address = await asyncio.to_thread(victim.read_until, "  serving    ", timeout_s=120)
            injection = new_injection(
                trigger="averaging_send",
                action="exit",
                at_chunk=1,  # the first chunk goes out, then the sender dies
                targets=Targets(nodes=(victim_key.node_id,)),
            )
            await publish(seed, OPERATOR, RUN.name, injection)

            async def armed() -> bool:
                info = (await client.call(address, Method.WORKER_INFO, timeout_s=5)).meta
                return info["injections"]["armed"] == [injection.id]

            await poll_until(armed, timeout_s=10, what="the victim to arm the record")
            assert not survivor.injections.armed  # not the survivor's record
            started = asyncio.create_task(
                client.call(address, Method.AVERAGING_START, {"round": 0}, timeout_s=30)
            )
            report = await survivor.averager.run_round(0)
            await asyncio.gather(started, return_exceptions=True)  # its caller loses the answer
            await wait_until_async(
                lambda: victim.proc.poll() is not None, timeout_s=10, what="the victim's exit"
            )
            assert victim.proc.returncode == INJECTED_EXIT_CODE
            # The survivor's reducer got at most the one chunk the victim sent before the exit
            # (at_chunk=1; the chunk may die in the victim's socket), banned it, and averaged its
            # own slice over itself. The victim's own slice came back only as far as the victim
            # reduced it before it died: its reducer runs beside its sender, so that part races.
            length = survivor.averager.layout.length(report.segment)
            slice_chunks = {
                len(chunk_bounds(lo, hi, survivor.averager.chunk_values))
                for lo, hi in slice_bounds(length, 2)
            }
            assert len(slice_chunks) == 1  # both halves cut into the same number of chunks
            chunks = slice_chunks.pop()
            from_victim = round(report.reduce_success * 2 * chunks) - chunks
            assert report.group_size == 2
            assert 0 <= from_victim <= injection.at_chunk
            assert 0.5 - 0.01 <= report.averaging_success < 1.0
            assert report.seconds < 15
            # a crash says no goodbye: no LEFT reached the DHT
            assert victim_key.node_id not in survivor.dht.left_ids()
        finally:
            await survivor.stop(grace_s=1)
