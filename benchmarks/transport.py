#!/usr/bin/env python3
"""Transport benchmark: Agora's RPC against raw pyzmq, measured in the same run.

    python benchmarks/transport.py [--json] [--rounds N] [--calls N] [--mib 64] [--smoke]

Figures:
  (a) 64 MiB (--mib) tensor request/response throughput vs raw PUSH/PULL of the same bytes
  (b) small-request round trip p50/p99 vs raw REQ/REP with asyncio sockets at both ends (the
      model every Agora node uses: an event loop between receive and reply). For reference: an
      asyncio REQ against a blocking REP server (no event loop on the server side: the
      baseline of earlier versions of this benchmark) and blocking sockets at both ends. The
      ping handler is a plain function, answered on the server's receive path as the DHT's
      lookups are; the same call to a coroutine handler (a task per request) is printed too
  (c) per-chunk LZ4 policy: effective throughput on random float32 with the policy vs without,
      and bytes on the wire for zero-heavy data with the policy vs without
  (d) authenticated (a): CURVE encryption, credential greeting, caller checked on every
      request, vs bare pyzmq CURVE PUSH/PULL of the same bytes (and vs plain Agora of (a))
  (e) authenticated (b): small-request round trip p50/p99 vs bare CURVE asyncio REQ/REP (both
      ends asyncio; a blocking CURVE REP server for reference) and vs plain Agora of (b)

Every server runs in its own process (``_transport_servers.py``), the client in this one, over loopback TCP. Each figure
is the median over several interleaved rounds (the machine is shared and noisy).

``--smoke``: one round of one 1 MiB transfer and 200 small requests of each kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from _secured import AUTHORIZER_SEED_ENV, SERVER_SEED_ENV, curve_client, key_from_env, new_seeds, security_of
from agora_core.auth.security import TransportSecurity
from agora_core.identity import NodeKey
from agora_core.rpc import RpcClient, RpcConfig
from agora_core.rpc.linkemu import LinkConfig, LinkEmulator
from agora_core.wire.codec import CompressionPolicy
from agora_core.wire.message import Kind, Message, WireConfig, encode
from agora_devkit.processes import spawn_python

MiB = 1 << 20
SERVERS_START_S = 60.0  # eight Python processes importing zmq and agora_core, on two cores
RAW_REPLY_S = 120.0  # a raw socket's reply: as long as the RPC calls' own timeout
SERVERS = str(Path(__file__).resolve().with_name("_transport_servers.py"))
NO_LZ4 = RpcConfig(wire=WireConfig(compression=CompressionPolicy(enabled=False)))


# --- measurements -------------------------------------------------------------------------


async def agora_transfer_s(client: RpcClient, address: str, tensor: np.ndarray, calls: int) -> float:
    """Seconds per request of ``tensor`` (tiny reply), over ``calls`` sequential calls."""
    t0 = time.perf_counter()
    for _ in range(calls):
        reply = await client.call(address, "sink", tensors={"x": tensor}, timeout_s=120)
        assert reply.meta["nbytes"] == tensor.nbytes
    return (time.perf_counter() - t0) / calls


def with_deadline(sock: zmq.Socket) -> zmq.Socket:
    """A blocking socket whose sends and receives give up (zmq.Again) after RAW_REPLY_S, and
    whose close drops what is unsent (nothing is, once a batch is acked)."""
    sock.setsockopt(zmq.RCVTIMEO, int(RAW_REPLY_S * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(RAW_REPLY_S * 1000))
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def raw_push_s(push: zmq.Socket, ack: zmq.Socket, payload: memoryview, calls: int) -> float:
    t0 = time.perf_counter()
    try:
        for _ in range(calls):
            push.send(payload, copy=False)
        push.send(b"n")
        assert int(ack.recv()) == calls * len(payload)
    except zmq.Again:
        raise TimeoutError(f"the PULL server took or acked no batch within {RAW_REPLY_S:g} s") from None
    return (time.perf_counter() - t0) / calls


async def agora_rtts(client: RpcClient, address: str, calls: int, method: str = "ping") -> list[float]:
    rtts = []
    for i in range(calls):
        t0 = time.perf_counter()
        await client.call(address, method, i)
        rtts.append(time.perf_counter() - t0)
    return rtts


async def first_call_s(
    address: str, security: TransportSecurity | None = None, server_key: bytes = b""
) -> float:
    """A fresh client's first small call: connecting included, and with a security the CURVE
    handshake and the credential greeting both ways."""
    async with RpcClient(security=security, node_id=security.key.node_id if security else "") as fresh:
        if security is not None:
            security.expect(address, server_key)
        t0 = time.perf_counter()
        await fresh.call(address, "ping", 0)
        return time.perf_counter() - t0


async def raw_async_rtts(
    address: str, calls: int, server_key: bytes | None = None, *, with_connect: bool = False
) -> list[float]:
    """Round trips on a fresh REQ socket; a CURVE client of ``server_key`` when given. The
    first (connecting, and the CURVE handshake) is left out unless ``with_connect``."""
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        curve_client(sock, server_key)
    sock.connect(address)
    try:
        # one deadline on the whole batch: a timer per call would be timed with the baseline
        rtts = await asyncio.wait_for(_async_round_trips(sock, calls + 1), RAW_REPLY_S)
    except TimeoutError:
        raise TimeoutError(
            f"{address}: {calls + 1} REQ/REP round trips not done in {RAW_REPLY_S:g} s"
        ) from None
    finally:
        sock.close()
    return rtts if with_connect else rtts[1:]  # the first includes connecting


async def _async_round_trips(sock: zmq.asyncio.Socket, calls: int) -> list[float]:
    rtts = []
    for i in range(calls):
        t0 = time.perf_counter()
        await sock.send(i.to_bytes(8, "little"))
        await sock.recv()
        rtts.append(time.perf_counter() - t0)
    return rtts


def raw_blocking_rtts(address: str, calls: int) -> list[float]:
    sock = with_deadline(zmq.Context.instance().socket(zmq.REQ))
    sock.connect(address)
    rtts = []
    try:
        for i in range(calls + 1):
            t0 = time.perf_counter()
            sock.send(i.to_bytes(8, "little"))
            sock.recv()
            rtts.append(time.perf_counter() - t0)
    except zmq.Again:
        raise TimeoutError(f"{address}: a blocking REQ got no reply within {RAW_REPLY_S:g} s") from None
    finally:
        sock.close()
    return rtts[1:]


def compare_rtts(report: Report, name: str, ours: list[float], base: list[float], baseline: str) -> None:
    """p50 (target <= 1.5x) and p99 of round trips ``ours`` against ``base``, in us."""
    for q in (50, 99):
        target = f"ratio <= 1.5 vs {baseline}" if q == 50 else None
        report.compare(
            f"{name}_p{q}", percentile(ours, q) * 1e6, percentile(base, q) * 1e6, "us", target=target
        )


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


async def run(report: Report, rounds: int, calls: int, mib: int) -> None:
    big = mib * MiB  # bytes of each tensor transfer
    rng = np.random.default_rng(0)
    noise = rng.random(big // 4, dtype=np.float32)  # incompressible float32
    zeros = np.zeros(big // 4, dtype=np.float32)
    zeros[::1024] = rng.random(zeros[::1024].size, dtype=np.float32)  # 99.9% zeros
    payload = memoryview(noise).cast("B")
    seeds = new_seeds()  # (d), (e): the run's authorizer and the servers' key, for this run only
    authorizer, server_key = key_from_env(AUTHORIZER_SEED_ENV, seeds), key_from_env(SERVER_SEED_ENV, seeds)
    secure = lambda kind: spawn_python([SERVERS, kind, "--secure"], env=seeds)  # noqa: E731
    report.note("starting the 8 server processes")
    with (
        spawn_python([SERVERS, "agora"]) as agora_node,
        spawn_python([SERVERS, "rep"]) as rep_node,
        spawn_python([SERVERS, "rep-async"]) as rep_async_node,
        spawn_python([SERVERS, "pull"]) as pull_node,
        secure("agora") as auth_node,
        secure("rep") as curve_rep_node,
        secure("rep-async") as curve_rep_async_node,
        secure("pull") as curve_pull_node,
        contextlib.ExitStack() as raw_sockets,  # closed first, before their servers stop
    ):
        listening = lambda node: node.read_until("ADDRESS ", timeout_s=SERVERS_START_S)  # noqa: E731
        agora_address = listening(agora_node)
        rep_address = listening(rep_node)
        rep_async_address = listening(rep_async_node)
        auth_address = listening(auth_node)
        curve_rep_address = listening(curve_rep_node)
        curve_rep_async_address = listening(curve_rep_async_node)
        ctx = zmq.Context.instance()
        push, ack, curve_push, curve_ack = (
            raw_sockets.enter_context(with_deadline(ctx.socket(kind)))
            for kind in (zmq.PUSH, zmq.PULL, zmq.PUSH, zmq.PULL)
        )
        curve_client(curve_push, server_key.public_key)  # the ack stays plain, as the server's
        for node, sockets in ((pull_node, (push, ack)), (curve_pull_node, (curve_push, curve_ack))):
            for sock, address in zip(sockets, listening(node).split(), strict=True):
                sock.connect(address)
        client_key = NodeKey.generate()
        secured = RpcClient(security=security_of(client_key, authorizer), node_id=client_key.node_id)
        secured.security.expect(auth_address, server_key.public_key)
        async with RpcClient() as client, RpcClient(config=NO_LZ4) as plain, secured:
            report.note("warming up: connections, the CURVE handshakes and greetings")
            await agora_transfer_s(client, agora_address, noise, 1)  # connect and warm up
            await agora_transfer_s(plain, agora_address, noise, 1)
            await agora_transfer_s(secured, auth_address, noise, 1)  # CURVE handshake, greeting
            raw_push_s(push, ack, payload, 1)
            raw_push_s(curve_push, curve_ack, payload, 1)

            # (a), (c) and (d): interleaved rounds, median seconds per transfer
            report.note(f"throughput: {rounds} rounds x {calls} transfers of {mib} MiB each")
            t_raw, t_agora, t_plain, t_zero, t_zero_plain, t_curve, t_auth = [], [], [], [], [], [], []

            def agora(cli, address, tensor):
                return lambda: agora_transfer_s(cli, address, tensor, calls)

            async def curve():
                return raw_push_s(curve_push, curve_ack, payload, calls)

            for i in range(rounds):
                t_raw.append(raw_push_s(push, ack, payload, calls))
                # alternate which of a compared pair goes first: no order bias
                pairs = [
                    (
                        (agora(client, agora_address, noise), t_agora),
                        (agora(plain, agora_address, noise), t_plain),
                    ),
                    (
                        (agora(client, agora_address, zeros), t_zero),
                        (agora(plain, agora_address, zeros), t_zero_plain),
                    ),
                    ((agora(secured, auth_address, noise), t_auth), (curve, t_curve)),
                ]
                for pair in pairs:
                    for measure, times in pair if i % 2 == 0 else pair[::-1]:
                        times.append(await measure())
            gbps = lambda seconds: big / statistics.median(seconds) / 1e9  # noqa: E731
            report.compare(
                f"tensor_{mib}MiB_request_throughput",
                gbps(t_agora),
                gbps(t_raw),
                "GB/s",
                target="ratio >= 0.8 vs raw PUSH/PULL",
            )
            report.add("raw_push_pull_throughput", gbps(t_raw), "GB/s")

            # (b) and (e): small requests
            report.note(f"round trips: {rounds} rounds x {calls * 200} small requests")
            ours, raw_async, raw_hybrid, raw_block, tasked = [], [], [], [], []
            auth, curve_async, curve_hybrid = [], [], []
            connect_plain, connect_auth, connect_curve = [], [], []  # (e): fresh connections
            n = calls * 200
            for i in range(rounds):
                ours += await agora_rtts(client, agora_address, n)
                tasked += await agora_rtts(client, agora_address, n // 4, "ping_task")
                raw_async += await raw_async_rtts(rep_async_address, n)
                raw_hybrid += await raw_async_rtts(rep_address, n)
                raw_block += raw_blocking_rtts(rep_address, n)
                curve_hybrid += await raw_async_rtts(curve_rep_address, n, server_key.public_key)
                pair = [(auth, agora_rtts(secured, auth_address, n))]
                pair.append((curve_async, raw_async_rtts(curve_rep_async_address, n, server_key.public_key)))
                for rtts, measure in pair if i % 2 == 0 else pair[::-1]:
                    rtts += await measure
                connect_plain.append(await first_call_s(agora_address))
                fresh = security_of(NodeKey.generate(), authorizer)
                connect_auth.append(await first_call_s(auth_address, fresh, server_key.public_key))
                rtt = await raw_async_rtts(curve_rep_address, 0, server_key.public_key, with_connect=True)
                connect_curve += rtt
            compare_rtts(report, "small_request_rtt", ours, raw_async, "raw asyncio REQ/REP")
            report.compare(  # the server side without an event loop: what asyncio costs there
                "small_request_rtt_p50_vs_asyncio_req_blocking_rep",
                percentile(ours, 50) * 1e6,
                percentile(raw_hybrid, 50) * 1e6,
                "us",
            )
            report.compare(
                "small_request_rtt_p50_vs_blocking_rep",
                percentile(ours, 50) * 1e6,
                percentile(raw_block, 50) * 1e6,
                "us",
            )
            report.compare(  # what a task per request costs on top (handlers that wait)
                "small_request_rtt_p50_coroutine_handler",
                percentile(tasked, 50) * 1e6,
                percentile(raw_async, 50) * 1e6,
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

            # (d) and (e): authenticated and encrypted, against bare CURVE sockets
            report.compare(
                f"auth_tensor_{mib}MiB_request_throughput",
                gbps(t_auth),
                gbps(t_curve),
                "GB/s",
                target="ratio >= 0.8 vs bare CURVE PUSH/PULL",
            )
            report.add("bare_curve_push_pull_throughput", gbps(t_curve), "GB/s")
            report.compare(f"auth_tensor_{mib}MiB_vs_plain_agora", gbps(t_auth), gbps(t_agora), "GB/s")
            compare_rtts(report, "auth_small_request_rtt", auth, curve_async, "bare CURVE asyncio REQ/REP")
            report.compare(
                "auth_small_request_rtt_p50_vs_curve_asyncio_req_blocking_rep",
                percentile(auth, 50) * 1e6,
                percentile(curve_hybrid, 50) * 1e6,
                "us",
            )
            report.compare(
                "auth_small_request_rtt_p50_vs_plain_agora",
                percentile(auth, 50) * 1e6,
                percentile(ours, 50) * 1e6,
                "us",
            )
            # a connection's setup: the CURVE handshake, then the greeting (once per connection)
            ms = lambda seconds: statistics.median(seconds) * 1e3  # noqa: E731
            report.compare("auth_first_call_on_new_connection", ms(connect_auth), ms(connect_plain), "ms")
            report.compare(
                "auth_first_call_vs_bare_curve_first_round_trip", ms(connect_auth), ms(connect_curve), "ms"
            )
        # Where links are slower than LZ4 (the internet, not loopback) the policy pays in time too.
        report.note("zero-heavy tensors over an emulated 1 Gbit/s link, LZ4 on and off")
        link = LinkEmulator(LinkConfig(up_bits_per_s=1e9))
        async with RpcClient(link=link) as shaped, RpcClient(link=link, config=NO_LZ4) as shaped_plain:
            on_s = await agora_transfer_s(shaped, agora_address, zeros, 1)
            off_s = await agora_transfer_s(shaped_plain, agora_address, zeros, 1)
        report.compare("lz4_policy_zero_heavy_over_1gbit_link", big / on_s / 1e9, big / off_s / 1e9, "GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved measurement rounds")
    parser.add_argument("--calls", type=int, default=4, help="tensor transfers per round")
    parser.add_argument("--mib", type=int, default=64, help="MiB of each tensor transfer (default 64)")
    _harness.add_arguments(parser, deadline_s=900)
    args = _harness.parse(parser, smoke={"rounds": 1, "calls": 1, "mib": 1})
    report = Report("transport", as_json=args.json)
    asyncio.run(run(report, args.rounds, args.calls, args.mib))
    report.finish()


if __name__ == "__main__":
    main()
