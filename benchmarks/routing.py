#!/usr/bin/env python3
"""Routing benchmark: what one trainer process costs and sustains, against zero-compute workers.

    python benchmarks/routing.py [--lanes 1 8 32] [--seconds 6] [--stages 4] [--json] [--smoke]

The workers (one per stage, all in one other process) answer every forward and backward at
once with zeros of the right shape: what is measured is the trainer. Figures per lane count:
samples/s and stage hops/s one trainer sustains; the trainer's own CPU time per hop
(process CPU time over hops, which excludes the workers entirely); wall time per hop.
``--smoke``: 2 lanes through 2 stages for half a second.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import RunConfig, parse_run_config
from agora_core.contract import Method, Phase
from agora_core.dht import DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.observability.logs import configure_logging
from agora_core.rpc import Payload, RpcServer
from agora_core.schema import WorkerAnnouncement, stage_workers_key
from agora_devkit.processes import spawn_python
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

SCRIPT = str(Path(__file__).resolve())
WORKERS_START_S = 60.0  # the workers' process announcing its stages
STOP_S = 60.0  # the trainer's lanes finishing their samples once told to stop


def run_config(stages: int) -> RunConfig:
    layers = ", ".join(["1"] * stages)
    return parse_run_config(
        f'name = "routing"\n[model]\nkind = "surrogate"\nd_model = 64\nn_heads = 2\nsubspace_rank = 16\n'
        f"seq_len = 128\nstage_layers = [{layers}]\n[dht]\ngossip_period_s = 0.5\nprobe_timeout_s = 0.25\n"
    )


async def serve_workers(stages: int) -> None:
    """One zero-compute worker per stage, all in this process, announced in the DHT."""
    configure_logging(fmt="json", level="warning")
    run = run_config(stages)
    k = run.model.subspace_rank
    seed = DhtNode(key=NodeKey.generate(), config=run.dht)
    await seed.start()
    nodes = [seed]
    for stage in range(stages):
        server = RpcServer()

        async def forward(request, stage=stage):
            b, t = request.tensors["tokens"].shape
            if stage == stages - 1:
                return Payload(tensors={"loss": np.zeros(b, np.float32)})
            return Payload(tensors={"boundary": np.zeros((b, t, k), np.float32)})

        async def backward(request, stage=stage):
            b, t = request.tensors["tokens"].shape
            return Payload(tensors={} if stage == 0 else {"grad": np.zeros((b, t, k), np.float32)})

        async def forward_backward(request):
            b, t = request.tensors["tokens"].shape
            return Payload(tensors={"loss": np.zeros(b, np.float32), "grad": np.zeros((b, t, k), np.float32)})

        for method, handler in (
            (Method.FORWARD, forward),
            (Method.BACKWARD, backward),
            (Method.FORWARD_BACKWARD, forward_backward),
        ):
            server.register(method, handler)
        key = NodeKey.generate()
        node = DhtNode(key=key, config=run.dht, bootstrap=[seed.address], server=server)
        await server.start()
        address = await node.start()
        nodes.append(node)
        announcement = WorkerAnnouncement(
            node_id=key.node_id,
            address=address,
            stage=stage,
            phase=Phase.SERVING,
            throughput=1000.0,
            load=0,
            max_batch=64,
            version="zero-compute",
        )
        await OwnedEntry(node, key, stage_workers_key(run.name, stage)).publish(announcement.to_value(), 3600)
    print(f"ADDRESS {seed.address}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for node in nodes:
        await node.stop()


async def measure(
    report: Report, bootstrap: str, shards: str, stages: int, lanes: int, seconds: float
) -> None:
    trainer = Trainer(
        run=run_config(stages),
        shards_dir=shards,
        key=NodeKey.generate(),
        bootstrap=[bootstrap],
        settings=TrainerSettings(lanes=lanes, state_file=str(Path(shards) / f"state-{lanes}.json")),
    )
    await trainer.start()
    try:
        training = asyncio.create_task(trainer.train())
        await asyncio.sleep(1.0)  # warm up: connections made, balancers measured
        done, cpu, wall = trainer.counters.completed, time.process_time(), time.perf_counter()
        await asyncio.sleep(seconds)
        done, cpu, wall = (
            trainer.counters.completed - done,
            time.process_time() - cpu,
            time.perf_counter() - wall,
        )
        trainer.request_stop()
        await stopped(training)
    finally:
        await trainer.close()
    if not done:
        raise RuntimeError(f"no sample completed in {seconds:g} s through {stages} zero-compute stages")
    hops = done * (2 * stages - 1)  # forwards of all but the tail, its forward_backward, backwards
    report.add(f"lanes={lanes} samples_per_s", done / wall, "samples/s")
    report.add(f"lanes={lanes} hops_per_s", hops / wall, "hops/s")
    report.add(f"lanes={lanes} trainer_cpu_per_hop", cpu / hops * 1e6, "us")
    report.add(f"lanes={lanes} wall_per_hop_per_lane", wall * lanes / hops * 1e6, "us")


async def stopped(training: asyncio.Task) -> None:
    """The trainer's ``train()``, told to stop, ending."""
    try:
        await asyncio.wait_for(training, STOP_S)
    except TimeoutError:
        raise TimeoutError(f"the trainer's lanes to stop, within {STOP_S:g} s") from None


async def run(report: Report, lane_counts: list[int], seconds: float, stages: int) -> None:
    with tempfile.TemporaryDirectory() as folder, spawn_python([SCRIPT, "--serve", str(stages)]) as workers:
        report.note("making 4 MB of byte shards")
        make_shards(folder, shards=1, tokenizer=ByteTokenizer(), max_bytes=4_000_000)
        report.note(f"{stages} zero-compute workers announced")
        bootstrap = await asyncio.to_thread(workers.read_until, "ADDRESS ", timeout_s=WORKERS_START_S)
        for lanes in lane_counts:
            report.note(f"{lanes} lanes through {stages} zero-compute stages for {seconds:g} s")
            await measure(report, bootstrap, folder, stages, lanes, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    _harness.add_arguments(parser, deadline_s=300)
    args = _harness.parse(parser, smoke={"lanes": [2], "seconds": 0.5, "stages": 2})
    if args.serve:  # the workers' process
        return asyncio.run(serve_workers(args.serve))
    configure_logging(fmt="console", level="warning")
    report = Report("routing", as_json=args.json)
    asyncio.run(run(report, args.lanes, args.seconds, args.stages))
    report.finish()


if __name__ == "__main__":
    main()
