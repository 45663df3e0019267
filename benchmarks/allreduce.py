#!/usr/bin/env python3
"""Averaging benchmark: Agora's butterfly all-reduce against torch.distributed gloo.

    python benchmarks/allreduce.py [--json] [--megabytes 100] [--rounds 7] [--peers 4] [--smoke]

Figures:
  (a) time to average a --megabytes float32 vector among --peers processes on loopback, vs
      gloo ``all_reduce`` of the same tensor among the same number of processes (same run,
      interleaved rounds, medians; each round's time is its slowest peer's); also vs gloo
      doing the same job as Agora, a sample-weighted mean (multiply, all_reduce, divide); and
      the robust round workers run (clipped, bounded, capped) vs the plain weighted mean
  (b) the same under link emulation (every peer's access link: 200 Mbit/s up and down, 40 ms
      one way), vs the lower bound that link sets: the bytes the busiest peer had to upload
      (measured on its sockets) / bandwidth. Any all-reduce uploads at least 2 (N-1)/N of the
      payload per peer (its share of the reduce-scatter and of the all-gather), so that bound
      is at least 1.5 x payload / bandwidth for 4 peers; the ratio to payload / bandwidth
      itself is printed too
  (c) under the same links, one of the senders (a peer that does not reduce) dies a third of
      the way into a round: the fraction of the vector the survivors got averaged, the
      fraction of inputs the reducers received, and the round's time

Every peer is its own OS process (a bare RPC server, client and reduction board: no worker,
no DHT), so the figures are the all-reduce's own.

``--smoke``: 2 peers, a 0.1 MB vector, one round of each kind, (a), (b) and (c) (with a chunk
timeout of 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.config.run import AveragingConfig, TransportConfig
from agora_core.contract import Phase
from agora_core.node.allocator import tune_for_large_messages
from agora_core.node.run_node import rpc_config
from agora_core.rpc import RpcClient, RpcServer
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator
from agora_devkit.processes import ChildProcess, spawn_python
from agora_worker.averaging.allreduce import RoundGuard, all_reduce
from agora_worker.averaging.board import ReductionBoard
from agora_worker.averaging.matchmaking import Group, Peer
from agora_worker.averaging.robust import DriftHistory

SCRIPT = str(Path(__file__).resolve())
LINK = "up=200M,down=200M,latency=40ms"
LINK_BITS_PER_S = 200e6
# One compute thread per peer process, gloo's and Agora's alike: with more peers than cores,
# torch's OpenMP workers (gloo peers' copies and weighting) would spin on the cores the next
# round needs.
PEER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
START_LEAD_S = 0.2  # a round starts this long after its commands go out, on every peer at once
AGORA_START_S = 120.0  # a peer process up and listening
GLOO_START_S = 180.0  # gloo peers importing torch and meeting at the store
# gloo's wait for its peers in any collective (torch's default: 30 minutes); the parent gives
# up on a round sooner, this only ends a peer left waiting
GLOO_TIMEOUT_S = 600.0
ROUND_MARGIN_S = 60.0  # the parent's wait for a round's reply beyond the round's own timeout


# --- peers (each runs as `allreduce.py --serve ...` in its own process) -------------------------


async def serve_agora(index: int, values_count: int, chunk_bytes: int, link_spec: str | None) -> None:
    tune_for_large_messages()  # as `agora-worker run` does at start
    link = LinkEmulator(LinkConfig.parse(link_spec)) if link_spec else None
    rpc = rpc_config(TransportConfig(chunk_bytes=chunk_bytes))  # as a worker's node builds it
    me = f"peer{index}"
    server = RpcServer(listen="127.0.0.1:0", config=rpc, link=link)
    client = RpcClient(config=rpc, link=link, node_id=me)  # reducers take a sender's chunks from it only
    board = ReductionBoard(server, early_wait_s=60.0, stage=0)  # an open run: access is not checked
    print(f"ADDRESS {await server.start()}", flush=True)
    values = np.random.default_rng(index).standard_normal(values_count, dtype=np.float32)
    loop = asyncio.get_running_loop()
    defaults = AveragingConfig()  # a worker's robustness, its history kept across rounds
    guard = RoundGuard(
        reducing=DriftHistory(multiplier=defaults.clip_multiplier, rounds=defaults.clip_history_rounds),
        receiving=DriftHistory(multiplier=defaults.clip_multiplier, rounds=defaults.clip_history_rounds),
    )
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        command = json.loads(line)
        group = Group(
            command["round"],
            tuple(
                Peer(
                    node_id=f"peer{i}",
                    address=a,
                    weight=1.0,
                    reducer=i in command["reducers"],
                    phase=Phase.SERVING,
                )
                for i, a in enumerate(command["addresses"])
            ),
        )
        # Every peer starts at the same instant, as gloo's peers leave a barrier together
        # (time.monotonic() is one system-wide clock on Linux).
        await asyncio.sleep(max(0.0, command["start_at"] - time.monotonic()))
        started = time.monotonic()
        uploaded = client.traffic.bytes_sent + server.traffic.bytes_sent
        if command.get("die_after_s") is not None:  # the failure under test: an abrupt death
            loop.call_later(command["die_after_s"], os._exit, 1)
        result = await all_reduce(
            board=board,
            client=client,
            group=group,
            me=me,
            values=values,
            chunk_values=chunk_bytes // 4,
            chunk_timeout_s=command["chunk_timeout_s"],
            deadline=started + command["timeout_s"],
            guard=guard if command.get("robust") else None,
        )
        if command.get("robust"):
            guard.close_round()
        outcome = {
            "seconds": time.monotonic() - started,
            "averaged": result.averaged_fraction,
            "reduce_success": result.reduce_success if result.reductions else None,
            "uploaded_bytes": client.traffic.bytes_sent + server.traffic.bytes_sent - uploaded,
        }
        del result  # a worker drops the differences once applied
        print(f"DONE {json.dumps(outcome)}", flush=True)
    await client.close()
    await server.stop()


def serve_gloo(rank: int, world: int, port: int, values_count: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=GLOO_TIMEOUT_S),
    )
    original = torch.from_numpy(np.random.default_rng(rank).standard_normal(values_count, dtype=np.float32))
    tensor = original.clone()
    print("READY", flush=True)
    for line in sys.stdin:
        weighted = json.loads(line).get("weighted", False)
        tensor.copy_(original)
        dist.barrier()
        started = time.monotonic()
        if weighted:  # the job Agora's round does: a sample-weighted mean (every weight 1 here)
            weight = torch.ones(1)
            tensor.mul_(weight)
            dist.all_reduce(weight)  # the total weight
            dist.all_reduce(tensor)
            tensor.div_(weight)
        else:
            dist.all_reduce(tensor)
        print(f"DONE {json.dumps({'seconds': time.monotonic() - started})}", flush=True)
    dist.destroy_process_group()


# --- the parent -----------------------------------------------------------------------------------


class Swarm:
    """N peer processes driven over stdin; a round's time is its slowest peer's."""

    def __init__(self, stack: contextlib.ExitStack, children: list[ChildProcess], addresses: list[str]):
        self.stack, self.children, self.addresses = stack, children, addresses
        self.round = 0

    @classmethod
    def agora(cls, stack, peers: int, values_count: int, chunk_bytes: int, link: str | None) -> Swarm:
        children, addresses = [], []
        for i in range(peers):
            args = [SCRIPT, "--serve", "agora", "--index", str(i), "--values", str(values_count)]
            args += ["--chunk-bytes", str(chunk_bytes)]
            child = stack.enter_context(spawn_python(args + (["--link", link] if link else []), env=PEER_ENV))
            children.append(child)
        for child in children:
            addresses.append(child.read_until("ADDRESS ", timeout_s=AGORA_START_S))
        return cls(stack, children, addresses)

    @classmethod
    def gloo(cls, stack, peers: int, values_count: int) -> Swarm:
        port = _free_port()
        tail = ["--port", str(port), "--values", str(values_count)]
        children = [
            stack.enter_context(
                spawn_python(
                    [SCRIPT, "--serve", "gloo", "--index", str(i), "--peers", str(peers), *tail], env=PEER_ENV
                )
            )
            for i in range(peers)
        ]
        for child in children:
            child.read_until("READY", timeout_s=GLOO_START_S)
        return cls(stack, children, [])

    def run(
        self,
        *,
        reducers=None,
        die: dict[int, float] | None = None,
        timeout_s=150.0,
        chunk_timeout_s=30.0,
        weighted=False,
        robust=False,
    ):
        """One round; returns each live peer's outcome (None for the peers that died).
        ``robust``: Agora peers clip, bound and cap (a worker's round) instead of taking a
        plain weighted mean."""
        self.round += 1
        die = die or {}
        start_at = time.monotonic() + START_LEAD_S
        for i, child in enumerate(self.children):
            command = {
                "round": self.round,
                "start_at": start_at,
                "addresses": self.addresses,
                "reducers": list(range(len(self.children))) if reducers is None else reducers,
                "timeout_s": timeout_s,
                "chunk_timeout_s": chunk_timeout_s,
                "die_after_s": die.get(i),
                "weighted": weighted,  # gloo peers: a weighted mean instead of a bare all_reduce
                "robust": robust,
            }
            child.proc.stdin.write((json.dumps(command) + "\n").encode())
            child.proc.stdin.flush()
        outcomes = []
        for i, child in enumerate(self.children):
            if i in die:
                outcomes.append(None)
                continue
            outcomes.append(json.loads(child.read_until("DONE ", timeout_s=timeout_s + ROUND_MARGIN_S)))
        return outcomes


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slowest(outcomes) -> float:
    return max(o["seconds"] for o in outcomes if o is not None)


def loopback_figures(report: Report, args: argparse.Namespace) -> None:
    """(a): Agora against gloo on loopback, interleaved rounds."""
    values_count, n = int(args.megabytes * 1e6) // 4, args.peers
    with contextlib.ExitStack() as stack:
        report.note(f"starting {n} Agora peers and {n} gloo peers")
        agora = Swarm.agora(stack, n, values_count, args.chunk_bytes, None)
        gloo = Swarm.gloo(stack, n, values_count)
        report.note("a warm-up round of each")
        agora.run()  # warm up connections and allocators, then measure
        agora.run(robust=True)
        gloo.run()
        ours, robust, theirs, weighted = [], [], [], []
        for r in range(args.rounds):
            report.note(f"round {r + 1} of {args.rounds} on loopback")
            ours.append(slowest(agora.run()))
            robust.append(slowest(agora.run(robust=True)))
            theirs.append(slowest(gloo.run()))
            weighted.append(slowest(gloo.run(weighted=True)))
            report.note(
                f"round {r + 1}: agora {ours[-1]:.3f} s (robust {robust[-1]:.3f} s), "
                f"gloo all_reduce {theirs[-1]:.3f} s, gloo weighted mean {weighted[-1]:.3f} s"
            )
        report.compare(
            "loopback_average_seconds",
            statistics.median(ours),
            statistics.median(theirs),
            "s (vs gloo all_reduce)",
            target="ratio <= 1.5",
        )
        report.compare(
            "loopback_vs_gloo_weighted_mean",
            statistics.median(ours),
            statistics.median(weighted),
            "s (vs gloo: weights applied, all_reduce, divided by the total weight)",
        )
        report.compare(
            "robust_vs_plain_round_seconds",
            statistics.median(robust),
            statistics.median(ours),
            "s (clipped, bounded and capped, as workers average, vs a plain weighted mean)",
            target="ratio <= 1.15",
        )


def linked_figures(report: Report, args: argparse.Namespace) -> None:
    """(b) and (c): under link emulation, clean rounds, then a round in which a sender dies."""
    payload = int(args.megabytes * 1e6)
    n = args.peers
    with contextlib.ExitStack() as stack:
        report.note(f"link emulation {LINK} on every peer ...")
        linked = Swarm.agora(stack, n, payload // 4, args.chunk_bytes, LINK)
        report.note(f"{args.link_rounds} rounds under link emulation")
        rounds = [linked.run() for _ in range(args.link_rounds)]
        seconds = statistics.median(slowest(outcomes) for outcomes in rounds)
        uploaded = max(o["uploaded_bytes"] for outcomes in rounds for o in outcomes)
        report.note(
            f"busiest peer uploaded {uploaded / 1e6:.1f} MB per round "
            f"({uploaded / payload:.3f} x the payload; an all-reduce's least is {2 * (n - 1) / n:.3f} x)"
        )
        report.compare(
            "linked_average_seconds",
            seconds,
            uploaded * 8 / LINK_BITS_PER_S,
            "s (vs the upload bound: busiest peer's bytes / bandwidth)",
            target="ratio <= 1.3",
        )
        report.compare(
            "linked_vs_payload_over_bandwidth",
            seconds,
            payload * 8 / LINK_BITS_PER_S,
            "s (vs payload / bandwidth)",
        )
        # (c) peer n-1 only sends (it reduces nothing) and dies a third of the way into the
        # round, while most of its chunks are still on its link
        report.note(f"a round in which peer {n - 1}, a sender, dies")
        chunk_timeout_s = args.death_chunk_timeout_s
        outcomes = linked.run(
            reducers=list(range(n - 1)), die={n - 1: seconds / 3}, chunk_timeout_s=chunk_timeout_s
        )
        survivors = [o for o in outcomes if o is not None]
        report.add("sender_death_survivors_averaged", min(o["averaged"] for o in survivors), "of the vector")
        report.add(
            "sender_death_reduce_success",
            statistics.mean(o["reduce_success"] for o in survivors if o["reduce_success"] is not None),
            "of the reducers' inputs",
        )
        report.add(
            "sender_death_round_seconds",
            slowest(survivors),
            f"s (clean round {seconds:.3g} s; chunk timeout {chunk_timeout_s:g} s, round timeout 150 s)",
        )


def serve(args: argparse.Namespace) -> None:
    if args.serve == "agora":
        asyncio.run(serve_agora(args.index, args.values, args.chunk_bytes, args.link))
    else:
        serve_gloo(args.index, args.peers, args.port, args.values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=100.0, help="vector size (10^6 bytes)")
    parser.add_argument("--peers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds on loopback")
    parser.add_argument("--link-rounds", type=int, default=1, help="rounds under link emulation")
    parser.add_argument("--loopback-only", action="store_true", help="only figure (a)")
    parser.add_argument(
        "--death-chunk-timeout-s",
        type=float,
        default=5.0,
        help="(c): how long a reducer waits for a chunk of the dead sender's (default 5)",
    )
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=TransportConfig().chunk_bytes,
        help="averaging chunk size (default: the run config's)",
    )
    parser.add_argument("--serve", choices=["agora", "gloo"], help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--values", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--link", help=argparse.SUPPRESS)
    _harness.add_arguments(parser, deadline_s=1200)
    args = _harness.parse(
        parser,
        smoke={"megabytes": 0.1, "peers": 2, "rounds": 1, "link_rounds": 1, "death_chunk_timeout_s": 1.0},
    )
    if args.serve:  # a peer
        serve(args)
        return

    report = Report("allreduce", as_json=args.json)
    report.note(
        f"{args.peers} peers, {args.megabytes:g} MB float32 each, chunks of {args.chunk_bytes / 2**20:g} MiB"
    )
    loopback_figures(report, args)
    if not args.loopback_only:
        linked_figures(report, args)
    report.finish()


if __name__ == "__main__":
    main()
