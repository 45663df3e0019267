#!/usr/bin/env python3
"""The servers of ``benchmarks/transport.py``, each run in its own process:

    python benchmarks/_transport_servers.py KIND [--secure]

KIND: ``agora`` (an RpcServer), ``rep`` (a blocking REP echo), ``rep-async`` (a REP echo on
an asyncio loop, as every Agora node's server runs) or ``pull`` (a PULL sink that acks each
batch). Each prints ``ADDRESS ...`` once it listens and exits when its stdin closes.
``--secure``: CURVE with the key whose seed is in the environment (see ``_secured``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading

import zmq
import zmq.asyncio

from _secured import AUTHORIZER_SEED_ENV, SERVER_SEED_ENV, curve_server, key_from_env, security_of
from agora_core.identity import NodeKey
from agora_core.rpc import Payload, RpcServer


async def serve_agora(key: NodeKey | None) -> None:
    """``key`` (every server's): its NodeKey when it serves the authenticated figures
    (``--secure``, seeds in the environment), else None."""
    security = None if key is None else security_of(key, key_from_env(AUTHORIZER_SEED_ENV))
    server = RpcServer(listen="127.0.0.1:0", security=security)

    def ping(request):  # a plain function: answered on the receive path, as the DHT's lookups
        return Payload(request.meta)

    async def ping_task(request):  # a coroutine handler: a task per request
        return Payload(request.meta)

    async def sink(request):
        return Payload({"nbytes": sum(t.nbytes for t in request.tensors.values())})

    server.register("ping", ping)
    server.register("ping_task", ping_task)
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


def serve_rep(key: NodeKey | None) -> None:
    _exit_when_stdin_closes()
    sock = zmq.Context.instance().socket(zmq.REP)
    if key is not None:
        curve_server(sock, key)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"ADDRESS tcp://127.0.0.1:{port}", flush=True)
    while True:
        sock.send_multipart(sock.recv_multipart(copy=False), copy=False)


async def serve_rep_async(key: NodeKey | None) -> None:
    """The raw baseline of an asyncio node: pyzmq's asyncio REP socket echoing each request,
    the event loop between receive and reply as in every Agora server."""
    _exit_when_stdin_closes()
    sock = zmq.asyncio.Context.instance().socket(zmq.REP)
    if key is not None:
        curve_server(sock, key)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"ADDRESS tcp://127.0.0.1:{port}", flush=True)
    while True:
        await sock.send_multipart(await sock.recv_multipart(copy=False), copy=False)


def serve_pull(key: NodeKey | None) -> None:
    """PULL the bytes; after each batch (announced by a 1-frame b"n" message), ack on PUSH.
    Secured, the data socket is a CURVE server (the tiny ack stays plain)."""
    _exit_when_stdin_closes()
    ctx = zmq.Context.instance()
    pull, ack = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    if key is not None:
        curve_server(pull, key)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=["agora", "rep", "rep-async", "pull"])
    parser.add_argument("--secure", action="store_true", help="CURVE, key seed from the environment")
    args = parser.parse_args()
    key = key_from_env(SERVER_SEED_ENV) if args.secure else None
    if args.kind == "agora":
        asyncio.run(serve_agora(key))
    elif args.kind == "rep-async":
        asyncio.run(serve_rep_async(key))
    else:
        {"rep": serve_rep, "pull": serve_pull}[args.kind](key)


if __name__ == "__main__":
    main()
