#!/usr/bin/env python3
"""GPU worker benchmark: one stage at the published run's width, served through the RPC, vs the
same module trained by a plain PyTorch loop on the same GPU.

    python benchmarks/gpu_worker.py [--seconds 45] [--lanes N] [--step-every 128]
                                    [--compute-weights fp32|bf16] [--width published|tiny]
                                    [--json] [--smoke]

Where CUDA is present: a worker process serves a body stage of d = 5120, k = 51, 4 blocks,
seq 4096 on the GPU (its coalescing limit measured from free memory after warm-up
microbatches, not set); this process is its local trainer, whose lanes each keep one
single-sample forward-then-backward in flight; the worker steps every ``--step-every``
samples (host AdamW, one transfer each way). Then, with the worker gone, the same module in a
plain loop on the same GPU at the worker's batch limit: a no-grad forward (the forward
request), a recomputed forward and the backward (the backward request), AdamW on the device
every ``--step-every`` samples, all under bf16 autocast. Figures: samples/s (target >= 0.85x
the loop), the mean coalesced batch, device utilization (NVML when installed, else the
compute thread's busy fraction), seconds per step on the compute thread and in transfer waits,
peak device memory, and host copies and uploads per step (target 1 each).

Where CUDA is absent it says so and runs the CPU path only: a small stage with a separate host
master (the same transfer code) through several steps of several microbatches each, giving
``host_copies_per_step`` and ``host_uploads_per_step``. It exits 0 either way.

``--smoke``: the served path and the plain loop for half a second each on a stage at tiny.toml's
width (``--width tiny``), on the GPU if there is one, else on the CPU (a CPU worker has no device memory and no
host transfers, so those figures are left out); then the CPU path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config import load_run_config
from agora_core.config.run import AveragingConfig, ModelConfig, OptimizerConfig, RunConfig
from agora_core.contract import Method
from agora_core.identity import NodeKey
from agora_core.observability.logs import configure_logging
from agora_core.rpc import RpcClient
from agora_devkit.processes import spawn_python
from agora_worker.model import build_stage
from agora_worker.optimizer.host import HostOptimizer
from agora_worker.serving.backend import StageBackend
from agora_worker.settings import WorkerSettings
from agora_worker.worker import Worker

SCRIPT = str(Path(__file__).resolve())
TINY = Path(SCRIPT).parent.parent / "examples" / "tiny.toml"
STAGE = 1  # a body: boundary in, boundary out
CALL_TIMEOUT_S = 300.0  # a request may queue behind a few large microbatches and a step
STARTUP_S = 900.0  # building a 5120-wide stage and measuring its memory takes a while


def gpu_run(step_every: int) -> RunConfig:
    """The published run's width; the body stage of interest has 4 blocks."""
    return RunConfig(
        name="gpu-worker",
        model=ModelConfig(d_model=5120, n_heads=40, subspace_rank=51, seq_len=4096, stage_layers=(1, 4, 1)),
        optimizer=OptimizerConfig(target_batch_size=step_every, warmup_steps=10),
        averaging=AveragingConfig(enabled=False),  # one replica: nothing to average with
    )


def tiny_run(step_every: int) -> RunConfig:
    """examples/tiny.toml's width (--smoke): the same path in seconds, on a CPU too."""
    run = load_run_config(TINY)
    return dataclasses.replace(
        run,
        optimizer=dataclasses.replace(run.optimizer, target_batch_size=step_every),
        averaging=dataclasses.replace(run.averaging, enabled=False),
    )


def stage_run(width: str, step_every: int) -> RunConfig:
    return gpu_run(step_every) if width == "published" else tiny_run(step_every)


# --- the CPU path -------------------------------------------------------------------------------


def cpu_path(report: Report, steps: int = 5, microbatches: int = 4) -> None:
    """The transfer code on the CPU: a separate host master, several microbatches per step."""
    run = load_run_config(TINY)
    module = build_stage(run, STAGE)
    optimizer = HostOptimizer(module, run.optimizer, clip_threshold=1.0, separate_master=True)
    backend = StageBackend(module, optimizer, torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    t, k = run.model.seq_len, run.model.subspace_rank
    for _ in range(steps):
        for _ in range(microbatches):
            tokens = torch.randint(0, run.model.vocab_size, (2, t), generator=generator)
            backend.backward(tokens, torch.randn(2, t, k, generator=generator), torch.randn(2, t, k))
        optimizer.apply()
    counts = optimizer.transfers.counts
    report.note(f"CPU path: {steps} steps of {microbatches} microbatches, separate host master")
    report.compare(
        "host_copies_per_step",
        counts.to_host / steps,
        float(microbatches),  # what copying after every microbatch made
        "transfers",
        target="1 (gradients to the host once per step; baseline: once per microbatch)",
    )
    report.add("host_uploads_per_step", counts.to_device / steps, "transfers", target="1")


# --- the GPU path: the worker ---------------------------------------------------------------------


async def serve(run: RunConfig, device: str, compute_weights: str) -> None:
    configure_logging(fmt="json", level="warning")
    settings = WorkerSettings(device=device, compute_weights=compute_weights, progress_interval_s=0.2)
    worker = Worker(run=run, stage=STAGE, key=NodeKey.generate(), settings=settings)
    print(f"ADDRESS {await worker.start()}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await worker.stop(grace_s=5)


def utilization_reader():
    """NVML's device utilization (0..1) if pynvml is installed, else None."""
    try:
        torch.cuda.utilization()
    except Exception:  # no pynvml, or no NVML on this machine
        return None
    return lambda: torch.cuda.utilization() / 100.0


async def served(address: str, run: RunConfig, lanes: int, seconds: float) -> dict:
    """Lanes of single samples for ``seconds``; the worker's info before and after, samples/s."""
    t, k = run.model.seq_len, run.model.subspace_rank
    rng = np.random.default_rng(0)
    done = 0
    readings: list[float] = []
    read_utilization = utilization_reader()
    async with RpcClient() as client:

        async def lane() -> None:
            nonlocal done
            tokens = rng.integers(0, run.model.vocab_size, (1, t), dtype=np.int64)
            boundary = rng.standard_normal((1, t, k), dtype=np.float32)
            grad = rng.standard_normal((1, t, k), dtype=np.float32)
            meta = {"stage": STAGE}
            while time.perf_counter() < stop_at:
                inputs = {"tokens": tokens, "boundary": boundary}
                await client.call(address, Method.FORWARD, meta, inputs, timeout_s=CALL_TIMEOUT_S)
                await client.call(
                    address, Method.BACKWARD, meta, {**inputs, "grad": grad}, timeout_s=CALL_TIMEOUT_S
                )
                done += 1

        async def sample_utilization() -> None:
            while read_utilization is not None and time.perf_counter() < stop_at:
                readings.append(read_utilization())
                await asyncio.sleep(0.25)  # a sampling period, not a synchronization

        before = (await client.call(address, Method.WORKER_INFO)).meta
        started = time.perf_counter()
        stop_at = started + seconds
        await asyncio.gather(sample_utilization(), *(lane() for _ in range(lanes)))
        elapsed = time.perf_counter() - started
        after = (await client.call(address, Method.WORKER_INFO)).meta
    return {
        "samples_per_s": done / elapsed,
        "elapsed": elapsed,
        "before": before,
        "after": after,
        "utilization": float(np.mean(readings)) if readings else None,
    }


async def worker_info(address: str) -> dict:
    async with RpcClient() as client:
        return (await client.call(address, Method.WORKER_INFO)).meta


# --- the GPU path: the plain loop -----------------------------------------------------------------


def plain_loop(run: RunConfig, batch: int, step_every: int, seconds: float, device: torch.device) -> dict:
    """The module trained in-process: forward, recompute + backward, device AdamW. On a CPU
    (--smoke without CUDA) in fp32, as a CPU worker computes, and no peak memory."""
    on_cuda = device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    module = build_stage(run, STAGE).to(device)
    params = [p for p in module.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(params, lr=run.optimizer.lr, weight_decay=run.optimizer.weight_decay)
    t, k = run.model.seq_len, run.model.subspace_rank
    tokens = torch.randint(0, run.model.vocab_size, (batch, t), device=device)
    boundary = torch.randn(batch, t, k, device=device)
    grad = torch.randn(batch, t, k, device=device)

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on_cuda)

    def synchronize() -> None:
        if on_cuda:
            torch.cuda.synchronize(device)

    def microbatch() -> None:
        with torch.no_grad(), autocast():
            module(tokens, boundary)  # the forward request
        x = boundary.detach().requires_grad_(True)
        with autocast():
            out = module(tokens, x)  # the backward request recomputes it
        torch.autograd.backward(out, grad)

    def step() -> float:
        synchronize()
        started = time.perf_counter()
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        synchronize()
        return time.perf_counter() - started

    microbatch()  # warm-up: kernels, the allocator, AdamW's state
    step()
    samples, since_step, step_seconds, steps = 0, 0, 0.0, 0
    synchronize()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        microbatch()
        samples += batch
        since_step += batch
        if since_step >= step_every:
            step_seconds += step()
            steps += 1
            since_step = 0
    synchronize()
    elapsed = time.perf_counter() - started
    return {
        "samples_per_s": samples / elapsed,
        "step_s": step_seconds / max(1, steps),
        "peak_bytes": torch.cuda.max_memory_allocated(device) if on_cuda else None,
    }


def served_path(report: Report, args: argparse.Namespace, device: str) -> None:
    """The worker on ``device`` through the RPC, then the plain loop on the same device."""
    run = stage_run(args.width, args.step_every)
    command = [
        SCRIPT,
        "--serve",
        "--step-every",
        str(args.step_every),
        "--compute-weights",
        args.compute_weights,
    ]
    command += ["--width", args.width, "--device", device]
    m = run.model
    report.note(
        f"starting the worker on {device}: d={m.d_model}, k={m.subspace_rank}, "
        f"{m.stage_layers[STAGE]} blocks, seq {m.seq_len}"
    )
    with spawn_python(command) as child:
        address = child.read_until("ADDRESS ", timeout_s=STARTUP_S)
        max_batch = int(asyncio.run(worker_info(address))["max_batch"])
        lanes = args.lanes or min(64, 2 * max_batch)
        report.note(f"worker serving, microbatches up to {max_batch} samples (measured); {lanes} lanes")
        asyncio.run(served(address, run, lanes, min(10.0, args.seconds)))  # warm-up
        report.note(f"{lanes} lanes for {args.seconds:g} s")
        result = asyncio.run(served(address, run, lanes, args.seconds))
        report.note("stopping the worker")
    report.note(f"plain loop at batch {max_batch}, AdamW on the device every {args.step_every} samples")
    loop = plain_loop(run, max_batch, args.step_every, args.seconds, torch.device(device))
    served_figures(report, result, loop, max_batch)


def served_figures(report: Report, result: dict, loop: dict, max_batch: int) -> None:
    before, after = result["before"], result["after"]
    steps = max(1, after["step"] - before["step"])
    sizes = after["recent_batch_sizes"][-200:]
    report.compare(
        "samples_per_s",
        result["samples_per_s"],
        loop["samples_per_s"],
        "samples/s",
        target="ratio >= 0.85 vs a plain PyTorch loop on the same GPU, recompute included",
    )
    report.add("max_batch", max_batch, "samples")
    report.add("mean_coalesced_batch", float(np.mean(sizes)) if sizes else 0.0, "samples")
    if result["utilization"] is not None:
        report.add("device_utilization", result["utilization"], "fraction (NVML)")
    else:
        busy = (after["compute_seconds"] - before["compute_seconds"]) / result["elapsed"]
        report.add("device_utilization", busy, "fraction (compute thread busy; no pynvml)")
    report.compare(
        "step_s",
        (after["optimizer_seconds"] - before["optimizer_seconds"]) / steps,
        loop["step_s"],
        "s",
        target="gradients down, host AdamW, uploads queued; baseline: AdamW on the device",
    )
    # a CPU worker (--smoke without CUDA) has neither: its weights are one shared copy
    moved_before, moved_after = before["transfers"], after["transfers"]
    if moved_after is not None:
        report.add(
            "host_transfer_wait_s_per_step", (moved_after["wait_s"] - moved_before["wait_s"]) / steps, "s"
        )
    if after["device_memory"] is not None:
        report.compare(
            "peak_device_memory",
            after["device_memory"]["peak"],
            loop["peak_bytes"],
            "bytes",
            target="ratio < 1",
        )
    if moved_after is not None:
        report.add(
            "host_copies_per_step",
            (moved_after["to_host"] - moved_before["to_host"]) / steps,
            "transfers",
            target="1",
        )
        report.add(
            "host_uploads_per_step",
            (moved_after["to_device"] - moved_before["to_device"]) / steps,
            "transfers",
            target="1",
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=45.0, help="served, and the plain loop, each")
    parser.add_argument("--lanes", type=int, default=0, help="trainer lanes (default: 2 x the batch limit)")
    parser.add_argument(
        "--step-every",
        type=int,
        default=128,
        help="samples per optimizer step (the published run: 1024 per stage step, over its replicas)",
    )
    parser.add_argument("--compute-weights", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument(
        "--width", choices=("published", "tiny"), default="published", help="the served stage's model"
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the served worker's
    _harness.add_arguments(parser, deadline_s=2400)
    args = _harness.parse(parser, smoke={"seconds": 0.5, "lanes": 2, "step_every": 4, "width": "tiny"})
    if args.serve:  # the worker
        return asyncio.run(serve(stage_run(args.width, args.step_every), args.device, args.compute_weights))
    report = Report("gpu_worker", as_json=args.json)
    if torch.cuda.is_available():
        served_path(report, args, "cuda")
    elif args.smoke:
        report.note("--smoke without CUDA: the served path on the CPU")
        served_path(report, args, "cpu")
    else:
        print(
            "gpu_worker: no CUDA device here, so no GPU figures (samples/s vs a plain loop, "
            "utilization, step and transfer time, peak memory); the CPU path's figures only",
            file=sys.stderr,
            flush=True,
        )
    cpu_path(report)
    report.finish()


if __name__ == "__main__":
    main()
