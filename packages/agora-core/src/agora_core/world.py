"""The world outside a node: its clocks, its randomness and its network, behind one seam.

Agora's code reads the time through ``world.monotonic()`` / ``world.wall()``, makes its random
generators with ``world.rng()`` and opens its sockets through ``world.network()``. By default
these are the real ones (``time.monotonic``, ``time.time``, an unseeded ``random.Random``,
ZeroMQ). The deterministic simulator (:mod:`agora_sim`) installs virtual ones for the span
of a simulation, so the same DHT, RPC and worker code runs in virtual time on an in-memory
network; nothing else in the packages knows which world it runs in.

The clocks are module attributes bound straight to the C functions, so a call costs what
``time.monotonic()`` costs: call them as ``world.monotonic()`` (never import the name, or an
installed simulation would not reach the caller). Sleeps and timeouts need no seam: asyncio's
own (``asyncio.sleep``, ``asyncio.timeout``, ``loop.call_at``) follow the loop's clock, and the
simulator's loop keeps virtual time.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agora_core.rpc.network import Network

# time.monotonic(): deadlines, timers, durations. Under a simulation: the virtual clock.
monotonic: Callable[[], float] = time.monotonic
# time.time(): record expirations, credential validity, timestamps in reports.
wall: Callable[[], float] = time.time
# time.time_ns(): the same in integer nanoseconds (incarnation numbers).
wall_ns: Callable[[], int] = time.time_ns

# Occupy the calling compute thread for some seconds (a surrogate stage's stand-in for compute,
# an injected slowdown): time.sleep. Under a simulation there is no compute thread: the seconds
# are billed, and the compute lane that ran the work waits them out in virtual time
# (take_held() says how many).
hold: Callable[[float], None] = time.sleep
take_held: Callable[[], float] = lambda: 0.0  # noqa: E731 - a binding like the others

_rng_factory: Callable[[Any], random.Random] = random.Random
_network: Network | None = None
_simulated = False


def rng(seed: Any = None) -> random.Random:
    """A random generator for one component. ``seed`` None: unseeded in the real world; under a
    simulation, drawn from the simulation's seed, so a run replays exactly."""
    return _rng_factory(seed)


async def offload(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` off the event loop (hashing, disk): on a thread of its own; under a
    simulation in line, because a thread's finish would come at a real, unrepeatable moment."""
    if _simulated:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def offload_to(executor: Executor, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args)`` on ``executor`` (one thread keeps a database's calls in commit order);
    under a simulation in line, as :func:`offload`."""
    if _simulated:
        return fn(*args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(executor, lambda: fn(*args, **kwargs))


def token_bytes(nbytes: int) -> bytes:
    """Random bytes (a nonce, a probe's payload): from the OS; under a simulation from its seed."""
    if _simulated:
        return _rng_factory(None).randbytes(nbytes)
    return os.urandom(nbytes)


def token_hex(nbytes: int) -> str:
    """A random name (a snapshot's, a file's): :func:`token_bytes` in hex."""
    return token_bytes(nbytes).hex()


def network() -> Network:
    """Where RPC servers bind and clients connect: ZeroMQ over TCP, or the simulated network."""
    global _network
    if _network is None:
        from agora_core.rpc.network import ZmqNetwork

        _network = ZmqNetwork()
    return _network


def simulated() -> bool:
    """True while a simulation is installed (for the few places that must refuse to run there,
    such as a thread that would step outside virtual time)."""
    return _simulated


def install(
    *,
    monotonic_fn: Callable[[], float],
    wall_fn: Callable[[], float],
    rng_factory: Callable[[Any], random.Random],
    network_impl: Network,
    hold_fn: Callable[[float], None],
    take_held_fn: Callable[[], float],
) -> None:
    """Replace the world (the simulator calls this; :func:`restore` undoes it)."""
    global monotonic, wall, wall_ns, hold, take_held, _rng_factory, _network, _simulated
    if _simulated:
        raise RuntimeError("a simulated world is installed already: restore() it first")
    monotonic = monotonic_fn
    wall = wall_fn
    wall_ns = lambda: int(wall_fn() * 1e9)  # noqa: E731 - a binding like the others
    hold, take_held = hold_fn, take_held_fn
    _rng_factory = rng_factory
    _network = network_impl
    _simulated = True


def restore() -> None:
    """Back to the real world."""
    global monotonic, wall, wall_ns, hold, take_held, _rng_factory, _network, _simulated
    monotonic, wall, wall_ns = time.monotonic, time.time, time.time_ns
    hold, take_held = time.sleep, lambda: 0.0
    _rng_factory = random.Random
    _network = None
    _simulated = False
