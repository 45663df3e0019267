"""A standalone RPC node for multi-process tests: prints its address, serves until stdin closes.

Methods: ``echo``; ``hang`` (waits until cancelled); ``stats`` (RSS and rejection counters);
``sink`` (streaming: rebuilds a tensor sent with send_tensor, hashing each chunk
``hash_rounds`` times, and reports the hash, peak memory growth and buffered items).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import os
import sys

from agora_core.observability.logs import configure_logging
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, RpcConfig, RpcServer, TensorAssembler
from agora_core.wire.message import WireConfig, WireLimits


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-message-bytes", type=int, default=WireLimits().max_message_bytes)
    args = parser.parse_args()
    configure_logging(fmt="json", level="warning", stream=sys.stderr)
    limits = WireLimits(max_message_bytes=args.max_message_bytes)
    config = RpcConfig(wire=WireConfig(chunk_bytes=min(2 << 20, limits.max_chunk_bytes), limits=limits))
    metrics = NodeMetrics(role="test", instance="rpc_node")
    window = int(os.environ.get("RPC_NODE_WINDOW", RpcConfig().stream_window))
    config = dataclasses.replace(config, stream_window=window)
    server = RpcServer(config=config, metrics=metrics)

    async def echo(request):
        return Payload(request.meta, request.tensors)

    async def hang(request):
        await asyncio.Event().wait()

    async def stats(request):
        rejected = {}
        for metric in metrics.registry.collect():
            for sample in metric.samples:
                if sample.name == "agora_rpc_rejected_messages_total":
                    rejected[sample.labels["reason"]] = sample.value
        return Payload({"rss": rss_bytes(), "hwm": rss_bytes("VmHWM"), "rejected": rejected})

    async def sink(stream):
        before = rss_bytes()
        assembler = TensorAssembler(max_bytes=1 << 31)
        digest = hashlib.sha256()
        max_buffered = 0
        rounds = int((stream.request.meta or {}).get("hash_rounds", 1))
        while not assembler.complete:
            max_buffered = max(max_buffered, stream.buffered)
            item = await stream.receive()
            if item is None:
                break
            for _ in range(rounds):  # a consumer slower than the sender: work per chunk
                digest.update(item.tensors["chunk"])
            assembler.add(item)
        tensor = assembler.result()
        return Payload(
            {
                "sha256": digest.hexdigest(),
                "nbytes": tensor.nbytes,
                "rss_growth": rss_bytes("VmHWM") - before,
                "max_buffered": max_buffered,
            }
        )

    server.register("echo", echo)
    server.register("hang", hang)
    server.register("stats", stats)
    server.register("sink", sink, stream=True)
    address = await server.start()
    print(f"ADDRESS {address}", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # parent closed our stdin: exit
    await server.stop()


if __name__ == "__main__":
    asyncio.run(main())
