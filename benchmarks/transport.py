#!/usr/bin/env python3
"""Transport benchmark: Agora's RPC against raw pyzmq, measured in the same run.

    python benchmarks/transport.py [--json] [--rounds N] [--calls N]

Figures:
  (a) 64 MiB tensor request/response throughput vs raw PUSH/PULL of the same bytes
  (b) small-request round trip p50/p99 vs raw REQ/REP (asyncio sockets, the model every Agora
      node uses; the blocking-socket figure is printed for reference)
  (c) per-chunk LZ4 policy: effective throughput on random float32 with the policy vs without,
      and bytes on the wire for zero-heavy data with the policy vs without

Every server runs in its own process, the client in this one, over loopback TCP. Each figure
is the median over several interleaved rounds (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.codec import CompressionPolicy
from agora_core.linkemu import LinkConfig, LinkEmulator
from agora_core.rpc import Payload, RpcClient, RpcConfig, RpcServer
from agora_core.testing import spawn_python
from agora_core.wire import Kind, Message, WireConfig, encode

MiB = 1 << 20
BIG = 64 * MiB
SCRIPT = str(Path(__file__).resolve())
NO_LZ4 = RpcConfig(wire=WireConfig(compression=CompressionPolicy(enabled=False)))


# --- servers (each runs as `transport.py --serve KIND` in its own process) --------------------


async def serve_agora() -> None:
    server = RpcServer(listen="127.0.0.1:0")

    async def ping(request):
        return Payload(request.meta)

    async def sink(request):
        return Payload({"nbytes": sum(t.nbytes for t in request.tensors.values())})

    server.register("ping", ping)
    server.register("sink", sink)
    print(f"ADDRESS {await server.start()}", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()


def _exit_when_stdin_closes() -> None:
    """The parent closes our stdin to stop us; blocking servers watch it from a thread."""

    def watch():
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def serve_rep() -> None:
    _exit_when_stdin_closes()
    sock = zmq.Context.instance().socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"ADDRESS tcp://127.0.0.1:{port}", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


def serve_pull() -> None:
    """PULL the bytes; after each batch (announced by a 1-frame b"n" message), ack on PUSH."""
    _exit_when_stdin_closes()
    ctx = zmq.Context.instance()
    pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    ack_port = ack.bind_to_random_port("tcp://127.0.0.1")
    print(f"ADDRESS tcp://127.0.0.1:{port} tcp://127.0.0.1:{ack_port}", flush=True)
    received = 0
    while True:
        frame = pull.recv(copy=False)
        if len(frame) == 1:
            ack.send(str(received).encode())
            received = 0
        else:
            received += len(frame)


# --- measurements -------------------------------------------------------------------------


async def agora_transfer_s(client: RpcClient, address: str, tensor: np.ndarray, calls: int) -> float:
    """Seconds per 64 MiB request (tiny reply), over ``calls`` sequential calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        reply = await client.call(address, "sink", tensors={"x": tensor}, timeout_s=120)
        assert reply.meta["nbytes"] == tensor.nbytes
    return (time.perf_counter() - t0) / calls


def raw_push_s(push: zmq.Socket, ack: zmq.Socket, payload: memoryview, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        push.send(payload, copy=False)
    push.send(b"n")
    assert int(ack.recv()) == calls * len(payload)
    return (time.perf_counter() - t0) / calls


async def agora_rtts(client: RpcClient, address: str, calls: int) -> list[float]:
    rtts = []
    for i in range(calls):
        t0 = time.perf_counter()
        await client.call(address, "ping", i)
        rtts.append(time.perf_counter() - t0)
    return rtts


async def raw_async_rtts(address: str, calls: int) -> list[float]:
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    rtts = []
    try:
        for i in range(calls + 1):
            t0 = time.perf_counter()
            await sock.send(i.to_bytes(8, "little"))
            await sock.recv()
            rtts.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return rtts[1:]  # the first includes connecting


def raw_blocking_rtts(address: str, calls: int) -> list[float]:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    rtts = []
    try:
        for i in range(calls + 1):
            t0 = time.perf_counter()
            sock.send(i.to_bytes(8, "little"))
            sock.recv()
            rtts.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return rtts[1:]


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def run(report: Report, rounds: int, calls: int) -> None:
    rng = np.random.default_rng(0)
    noise = rng.random(BIG // 4, dtype=np.float32)  # 64 MiB of incompressible float32
    zeros = np.zeros(BIG // 4, dtype=np.float32)
    zeros[::1024] = rng.random(zeros[::1024].size, dtype=np.float32)  # 99.9% zeros
    with (
        spawn_python([SCRIPT, "--serve", "agora"]) as agora_node,
        spawn_python([SCRIPT, "--serve", "rep"]) as rep_node,
        spawn_python([SCRIPT, "--serve", "pull"]) as pull_node,
    ):
        agora_address = agora_node.read_until("ADDRESS ")
        rep_address = rep_node.read_until("ADDRESS ")
        pull_address, ack_address = pull_node.read_until("ADDRESS ").split()
        ctx = zmq.Context.instance()
        push, ack = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.connect(pull_address)
        ack.connect(ack_address)
        async with RpcClient() as client, RpcClient(config=NO_LZ4) as plain:
            await agora_transfer_s(client, agora_address, noise, 1)  # connect and warm up
            await agora_transfer_s(plain, agora_address, noise, 1)
            raw_push_s(push, ack, memoryview(noise).cast("B"), 1)

            # (a) and (c): interleaved rounds, median seconds per 64 MiB
            report.note(f"throughput: {rounds} rounds x {calls} transfers of 64 MiB each")
            t_raw, t_agora, t_plain, t_zero, t_zero_plain = [], [], [], [], []
            for i in range(rounds):
                t_raw.append(raw_push_s(push, ack, memoryview(noise).cast("B"), calls))
                # alternate which of a compared pair goes first: no order bias
                pairs = [((client, t_agora), (plain, t_plain)), ((client, t_zero), (plain, t_zero_plain))]
                for tensor, pair in zip((noise, zeros), pairs, strict=True):
                    for cli, times in pair if i % 2 == 0 else pair[::-1]:
                        times.append(await agora_transfer_s(cli, agora_address, tensor, calls))
            gbps = lambda seconds: BIG / statistics.median(seconds) / 1e9  # noqa: E731
            report.compare(
                "tensor_64MiB_request_throughput",
                gbps(t_agora),
                gbps(t_raw),
                "GB/s",
                target="ratio >= 0.8 vs raw PUSH/PULL",
            )
            report.add("raw_push_pull_throughput", gbps(t_raw), "GB/s")

            # (b) small requests
            report.note(f"round trips: {rounds} rounds x {calls * 200} small requests")
            ours, raw_async, raw_block = [], [], []
            for _ in range(rounds):
                ours += await agora_rtts(client, agora_address, calls * 200)
                raw_async += await raw_async_rtts(rep_address, calls * 200)
                raw_block += raw_blocking_rtts(rep_address, calls * 200)
            for q in (50, 99):
                report.compare(
                    f"small_request_rtt_p{q}",
                    percentile(ours, q) * 1e6,
                    percentile(raw_async, q) * 1e6,
                    "us",
                    target="ratio <= 1.5 vs raw asyncio REQ/REP" if q == 50 else None,
                )
            report.compare(
                "small_request_rtt_p50_vs_blocking_rep",
                percentile(ours, 50) * 1e6,
                percentile(raw_block, 50) * 1e6,
                "us",
            )

            # (c) the LZ4 policy
            report.compare(
                "lz4_policy_random_float32_throughput",
                gbps(t_agora),
                gbps(t_plain),
                "GB/s",
                target="ratio >= 0.95 vs compression off",
            )
            wire = lambda tensor, config: sum(  # noqa: E731
                memoryview(f).nbytes
                for f in encode(Message(kind=Kind.REQUEST, tensors={"x": tensor}), config)
            )
            on, off = wire(zeros, WireConfig()), wire(zeros, NO_LZ4.wire)
            report.compare(
                "lz4_policy_zero_heavy_wire_bytes",
                on / MiB,
                off / MiB,
                "MiB",
                target="ratio < 1: bytes shrink",
            )
            report.compare("lz4_policy_zero_heavy_throughput", gbps(t_zero), gbps(t_zero_plain), "GB/s")
        # Where links are slower than LZ4 (the internet, not loopback) the policy pays in time too.
        link = LinkEmulator(LinkConfig(up_bits_per_s=1e9))
        async with RpcClient(link=link) as shaped, RpcClient(link=link, config=NO_LZ4) as shaped_plain:
            on_s = await agora_transfer_s(shaped, agora_address, zeros, 1)
            off_s = await agora_transfer_s(shaped_plain, agora_address, zeros, 1)
        report.compare("lz4_policy_zero_heavy_over_1gbit_link", BIG / on_s / 1e9, BIG / off_s / 1e9, "GB/s")
        push.close()
        ack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds")
    parser.add_argument("--calls", type=int, default=4, help="64 MiB transfers per round")
    parser.add_argument("--serve", choices=["agora", "rep", "pull"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve == "agora":
        return asyncio.run(serve_agora())
    if args.serve == "rep":
        return serve_rep()
    if args.serve == "pull":
        return serve_pull()
    report = Report("transport", as_json=args.json)
    asyncio.run(run(report, args.rounds, args.calls))
    report.finish()


if __name__ == "__main__":
    main()
