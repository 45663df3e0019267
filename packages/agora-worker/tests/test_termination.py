"""Self-termination in real worker processes: each rule's cause is injected into a worker of
stage 1 (surrogate), which must withdraw, publish why, leave and exit with the rule's code.

Causes: requests holding the surrogate's ``fail_token`` (compute fails), a backward holding its
``nan_token`` (NaN gradients), the death of the only other DHT member, a sample that never
makes a batch, a 1 MiB memory limit, and a fake reducer that never answers averaging streams.
Every test runs its own run name against one shared DHT seed, so their DHT entries never mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass

import numpy as np
import pytest

from agora_core.config.run import DhtConfig
from agora_core.contract import DepartureReason, Phase
from agora_core.dht import BlockingDht, owned_subkey
from agora_core.errors import HandlerFailed
from agora_core.identity import NodeKey
from agora_core.schema import (
    WorkerDeparture,
    averaging_round_key,
    parse_entries,
    stage_departures_key,
    stage_workers_key,
)
from agora_devkit.processes import ChildProcess, spawn_python
from agora_devkit.prometheus import pushgateway_process
from agora_devkit.runs import tiny_run_toml
from agora_worker.averaging.matchmaking import Peer
from agora_worker.termination import EXIT_CODES

pytestmark = pytest.mark.slow
STAGE = 1
FAIL_TOKEN, NAN_TOKEN = 7, 9
START_S = 30.0  # a worker process imports torch, joins, announces
TRIP_S = 15.0  # from the injected cause to the exit
DHT = DhtConfig(gossip_period_s=0.2, probe_timeout_s=0.1, suspicion_timeout_s=1.0, op_timeout_s=1.0)


@dataclass
class Running:
    child: ChildProcess
    run_name: str
    node_id: str
    address: str


@contextlib.contextmanager
def worker(
    tmp_path,
    run_name: str,
    rules: dict,
    *,
    bootstrap: str,
    reducer: str,
    batch: int = 8,
    env: dict | None = None,
):
    """A worker process of stage 1 under ``[termination]`` ``rules`` (``env``: more variables);
    stopped however the block ends."""
    config = tmp_path / f"{run_name}.toml"
    config.write_text(
        tiny_run_toml(
            run_name,
            seed=3,
            dht={"suspicion_timeout_s": 1.0, "op_timeout_s": 1.0},
            optimizer={"target_batch_size": batch},
            averaging={
                "segments": 1,
                "cadence_steps": 100000,
                "matchmaking_window_s": 2.0,
                "round_timeout_s": 5.0,
                "chunk_timeout_s": 2.0,
                "reducers": "listed",
                "reducer_ids": [reducer],
            },
            termination={"check_interval_s": 0.1, **rules},
            **{"model.surrogate": {"fail_token": FAIL_TOKEN, "nan_token": NAN_TOKEN}},
        )
    )
    command = [
        *("-m", "agora_worker", "run", "--config", str(config), "--stage", str(STAGE)),
        *("--bootstrap", bootstrap, "--device", "cpu", "--key-file", str(tmp_path / f"{run_name}.key")),
        *("--progress-interval", "0.05", "--announce-interval", "0.2"),
    ]
    with spawn_python(command, env={"AGORA_LOG_LEVEL": "error", **(env or {})}) as child:
        node_id = child.read_until("  node id    ", timeout_s=START_S)
        address = child.read_until("  serving    ", timeout_s=START_S)
        yield Running(child, run_name, node_id, address)


async def exits_for(running: Running, reason: DepartureReason) -> str:
    """Wait for the worker to say it terminated for ``reason`` and exit with its code; the detail."""
    line = await asyncio.to_thread(running.child.read_until, "terminated: ", timeout_s=TRIP_S)
    assert line.startswith(f"{reason} (exit code {EXIT_CODES[reason]})"), line
    code = await asyncio.to_thread(running.child.proc.wait, TRIP_S)
    assert code == EXIT_CODES[reason]
    return line


async def departure_of(process_seed: BlockingDht, running: Running) -> WorkerDeparture:
    """What the departed worker told the DHT, read by another member; its announcement is gone."""
    found = await asyncio.to_thread(process_seed.get, stage_departures_key(running.run_name, STAGE))
    mine = [d for d in parse_entries(found, WorkerDeparture.from_value) if d.node_id == running.node_id]
    assert len(mine) == 1, found
    assert await asyncio.to_thread(process_seed.get, stage_workers_key(running.run_name, STAGE)) == {}
    return mine[0]


def sample(token: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(token)
    tokens = rng.integers(10, 256, (1, 8), dtype=np.int64)
    tokens[0, 3] = token
    boundary = rng.standard_normal((1, 8, 4), dtype=np.float32)
    return {"tokens": tokens, "boundary": boundary, "grad": boundary}


async def test_a_worker_whose_compute_keeps_failing_terminates_for_device_failure(
    tmp_path, process_seed, client
):
    args = {"bootstrap": process_seed.address, "reducer": process_seed.node.node_id}
    with worker(tmp_path, "term-device", {"compute_failures": 3}, **args) as running:
        forward = {k: v for k, v in sample(FAIL_TOKEN).items() if k != "grad"}
        for _ in range(3):
            with pytest.raises(HandlerFailed, match="injected failure"):
                await client.call(running.address, "forward", {"stage": STAGE}, forward, timeout_s=10)
        detail = await exits_for(running, DepartureReason.DEVICE_FAILURE)
        assert "3 compute requests failed in a row" in detail
        departure = await departure_of(process_seed, running)
        assert (departure.value, departure.threshold, departure.unit) == (3.0, 3.0, "requests")
        assert departure.exit_code == EXIT_CODES[DepartureReason.DEVICE_FAILURE] and departure.stage == STAGE


async def test_a_worker_whose_gradient_is_nan_terminates_at_its_step(tmp_path, process_seed, client):
    args = {"bootstrap": process_seed.address, "reducer": process_seed.node.node_id}
    with worker(tmp_path, "term-nan", {"nonfinite_steps": 1}, batch=1, **args) as running:
        # inputs are checked for NaN on arrival; the NaN arises in the stage (fault injection)
        await client.call(running.address, "backward", {"stage": STAGE}, sample(NAN_TOKEN), timeout_s=10)
        await exits_for(running, DepartureReason.NONFINITE_GRADIENTS)
        departure = await departure_of(process_seed, running)
        assert departure.reason is DepartureReason.NONFINITE_GRADIENTS and departure.step == 1


async def test_a_worker_cut_off_from_the_dht_terminates_as_unreachable(tmp_path, process_seed):
    # Its only other DHT member dies: nobody is left to hear its departure, so this test reads
    # what the worker says on the way out and its exit code.
    alone = BlockingDht(key=NodeKey.generate(), config=DHT, timeout_s=10.0)
    alone.start()
    try:
        args = {"bootstrap": alone.address, "reducer": process_seed.node.node_id}
        with worker(tmp_path, "term-unreachable", {"unreachable_s": 1.0}, **args) as running:
            alone.stop(leave=False)  # dies without a word: the worker has to find out
            killed = time.monotonic()
            detail = await exits_for(running, DepartureReason.UNREACHABLE)
            assert "no other DHT member alive" in detail
            # suspicion (1 s), then the rule's 1 s, then leaving: not at once, and not long after
            assert 1.0 < time.monotonic() - killed < TRIP_S
    finally:
        alone.stop(leave=False)


async def test_a_worker_holding_samples_while_its_stage_never_steps_terminates(
    tmp_path, process_seed, client
):
    args = {"bootstrap": process_seed.address, "reducer": process_seed.node.node_id}
    with worker(tmp_path, "term-stall", {"no_progress_s": 0.5}, batch=8, **args) as running:
        info = (await client.call(running.address, "worker.info", timeout_s=10)).meta
        assert info["step"] == 0  # idle so far: an idle worker is not stalled
        await client.call(running.address, "backward", {"stage": STAGE}, sample(20), timeout_s=10)
        await exits_for(running, DepartureReason.NO_PROGRESS)  # 1 of 8 samples: no step comes
        departure = await departure_of(process_seed, running)
        assert departure.value >= 0.5 and departure.threshold == 0.5 and departure.unit == "s"


async def test_a_worker_over_its_memory_limit_terminates_and_its_last_push_says_why(tmp_path, process_seed):
    args = {"bootstrap": process_seed.address, "reducer": process_seed.node.node_id}
    with pushgateway_process() as gateway:
        env = {"AGORA_METRICS_PUSH_GATEWAY": gateway.address}
        with worker(tmp_path, "term-rss", {"max_host_rss_mib": 1}, **args, env=env) as running:
            await exits_for(running, DepartureReason.HOST_MEMORY)
            departure = await departure_of(process_seed, running)
            assert departure.unit == "MiB" and departure.threshold == 1.0
            assert departure.value > 20.0  # a worker with torch loaded holds tens of MiB at least
        # not a clean exit: its group stays on the gateway, with the reason (monitoring/alerts.yml)
        group = gateway.group(instance=running.node_id[:12])
        assert group is not None and group.labels["run"] == "term-rss"
        assert group.value("agora_worker_terminated", reason="host_memory") == 1
        assert group.value("agora_worker_terminated", reason="device_failure") == 0
        assert group.value("agora_worker_terminations_total", reason="host_memory") == 1


async def test_a_worker_failing_two_of_three_averaging_rounds_terminates(tmp_path, process_seed, client):
    # The seed poses as the round's only reducer: it joins the group, then never answers a stream.
    run_name = "term-averaging"
    fake = Peer(
        node_id=process_seed.node.node_id,
        address=process_seed.address,
        weight=1.0,
        reducer=True,
        phase=Phase.SERVING,
    )
    for round_index in (0, 1):
        await asyncio.to_thread(
            process_seed.store,
            averaging_round_key(run_name, STAGE, round_index),
            owned_subkey(process_seed.node.key.public_key),
            asdict(fake),
            time.time() + 120,
            signer=process_seed.node.key,
        )
    args = {"bootstrap": process_seed.address, "reducer": process_seed.node.node_id}
    with worker(tmp_path, run_name, {"failed_rounds": 2, "rounds_window": 3}, **args) as running:
        for round_index in (0, 1):
            reply = await client.call(
                running.address, "averaging.start", {"round": round_index}, timeout_s=15
            )
            assert reply.meta["group_size"] == 2 and reply.meta["averaging_success"] == 0.0
        await exits_for(running, DepartureReason.AVERAGING_FAILURES)
        departure = await departure_of(process_seed, running)
        assert (departure.value, departure.threshold, departure.unit) == (2.0, 2.0, "rounds")
