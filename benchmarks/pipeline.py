#!/usr/bin/env python3
"""Pipeline benchmark: a swarm's tokens/s and how busy its bottleneck stage is kept.

    python benchmarks/pipeline.py [--lanes 2 4 8 16 32] [--seconds 10] [--stages 4] [--json] [--smoke]

Real ``agora-worker`` processes, one per stage, serve surrogate stages whose compute is an
injected per-sample delay (forward 5 ms, backward 10 ms), so each stage's compute bound is
known; one stage (the bottleneck) is twice as slow. One in-process trainer drives samples
through them with L lanes. Figures per lane count, over a measurement window after a warm-up:
  * tokens/s the swarm trains
  * bottleneck utilization: the bottleneck worker's compute time / wall time (target >= 0.9
    at every lane count from 4 to 32; 2 lanes cannot saturate 4 stages)
  * tokens/s over the bottleneck's own compute bound (samples per compute-second it showed in
    the window): how close the pipeline runs to its slowest stage
``--smoke``: 2 lanes through 2 stages for half a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
from pathlib import Path

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import load_run_config
from agora_core.contract import Method
from agora_core.dht import DhtNode
from agora_core.identity import NodeKey
from agora_core.observability.logs import configure_logging
from agora_core.rpc import RpcClient
from agora_devkit.processes import spawn_python
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.trainer import Trainer, TrainerSettings

FORWARD_S, BACKWARD_S = 0.005, 0.010
SLOWDOWN = 2.0  # the bottleneck stage's delay scale
WORKER_START_S = 120.0  # a worker process serving, on a busy machine
STOP_S = 60.0  # the trainer's lanes finishing their samples once told to stop


def write_config(folder: Path, stages: int) -> Path:
    layers = ", ".join(["1"] * stages)
    path = folder / "pipeline.toml"
    path.write_text(
        f'name = "pipeline"\n[model]\nkind = "surrogate"\nd_model = 64\nn_heads = 2\nsubspace_rank = 16\n'
        f"seq_len = 128\nvocab_size = 256\nstage_layers = [{layers}]\n"
        f"[model.surrogate]\nforward_delay_s = {FORWARD_S}\nbackward_delay_s = {BACKWARD_S}\n"
        # no optimizer steps or averaging rounds inside the window: compute is what is measured
        "[optimizer]\ntarget_batch_size = 1000000\n[averaging]\nenabled = false\n"
        "[dht]\ngossip_period_s = 0.5\nprobe_timeout_s = 0.25\n"
    )
    return path


async def measure(report, run, shards, bootstrap, bottleneck: str, lanes: int, seconds: float) -> None:
    trainer = Trainer(
        run=run,
        shards_dir=shards,
        key=NodeKey.generate(),
        bootstrap=[bootstrap],
        settings=TrainerSettings(lanes=lanes, state_file=str(Path(shards) / f"state-{lanes}.json")),
    )
    client = RpcClient()
    await trainer.start()
    try:
        training = asyncio.create_task(trainer.train())
        await asyncio.sleep(2.0)  # warm-up: connections, balancer estimates, a full pipeline
        before = (await client.call(bottleneck, Method.WORKER_INFO)).meta
        done, wall = trainer.counters.completed, time.perf_counter()
        await asyncio.sleep(seconds)
        after = (await client.call(bottleneck, Method.WORKER_INFO)).meta
        done, wall = trainer.counters.completed - done, time.perf_counter() - wall
        trainer.request_stop()
        await stopped(training)
    finally:
        await trainer.close()
        await client.close()
    compute = after["compute_seconds"] - before["compute_seconds"]
    processed = after["processed"] - before["processed"]  # forward + backward passes
    tokens_per_s = done * run.model.seq_len / wall
    report.add(f"lanes={lanes} tokens_per_s", tokens_per_s, "tokens/s")
    # the target holds from 4 lanes: 2 lanes cannot keep 4 stages busy
    target = ">= 0.9 saturated" if lanes >= 4 else None
    report.add(f"lanes={lanes} bottleneck_utilization", compute / wall, "of wall time", target=target)
    name = f"lanes={lanes} tokens_per_s_vs_bottleneck_bound"
    if compute:
        # each sample costs the bottleneck one forward and one backward
        bound = processed / 2 / compute * run.model.seq_len
        report.compare(name, tokens_per_s, bound, "tokens/s")
    else:  # the bottleneck computed nothing in the window: no bound to compare with
        report.add(name, tokens_per_s, "tokens/s")


async def stopped(training: asyncio.Task) -> None:
    """The trainer's ``train()``, told to stop, ending."""
    try:
        await asyncio.wait_for(training, STOP_S)
    except TimeoutError:
        raise TimeoutError(f"the trainer's lanes to stop, within {STOP_S:g} s") from None


async def run(report: Report, lane_counts: list[int], seconds: float, stages: int) -> None:
    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as stack:
        config = write_config(Path(folder), stages)
        run_config = load_run_config(config)
        shards = Path(folder) / "shards"
        report.note("making 4 MB of byte shards")
        make_shards(shards, shards=1, tokenizer=ByteTokenizer(), max_bytes=4_000_000)
        seed = DhtNode(key=NodeKey.generate(), config=run_config.dht)
        await seed.start()
        try:
            slow = stages // 2
            addresses = []
            for stage in range(stages):
                args = ["-m", "agora_worker", "run", "--config", str(config), "--stage", str(stage)]
                args += [
                    "--bootstrap",
                    seed.address,
                    "--device",
                    "cpu",
                    "--key-file",
                    f"{folder}/w{stage}.key",
                ]
                if stage == slow:
                    args += ["--surrogate-delay-scale", str(SLOWDOWN)]
                env = {"AGORA_LOG_LEVEL": "warning", "OMP_NUM_THREADS": "1"}  # more processes than cores
                child = stack.enter_context(spawn_python(args, env=env))
                addresses.append(child)
            report.note(f"{stages} worker processes serving")
            addresses = [
                await asyncio.to_thread(c.read_until, "  serving    ", timeout_s=WORKER_START_S)
                for c in addresses
            ]
            report.note(
                f"{stages} surrogate stages (forward {FORWARD_S * 1e3:g} ms, backward {BACKWARD_S * 1e3:g} ms "
                f"per sample), stage {slow} {SLOWDOWN:g}x slower"
            )
            for lanes in lane_counts:
                report.note(f"{lanes} lanes for {seconds:g} s")
                await measure(report, run_config, shards, seed.address, addresses[slow], lanes, seconds)
        finally:
            await seed.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lanes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--stages", type=int, default=4)
    _harness.add_arguments(parser, deadline_s=300)
    args = _harness.parse(parser, smoke={"lanes": [2], "seconds": 0.5, "stages": 2})
    configure_logging(fmt="console", level="warning")
    report = Report("pipeline", as_json=args.json)
    asyncio.run(run(report, args.lanes, args.seconds, args.stages))
    report.finish()


if __name__ == "__main__":
    main()
