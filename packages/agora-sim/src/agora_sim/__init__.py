"""Deterministic simulation: Agora's own code on a simulated network, in virtual time.

    with Simulation(seed=7) as sim:
        host = sim.network.add_host("dht-0", LinkModel(latency_s=0.05))
        with host.active():  # what runs here, and every task it starts, is on that host
            node = DhtNode(key=sim.key())
            sim.run(node.start())
        sim.run_for(60.0)  # a virtual minute, in a fraction of a real second

Inside, :mod:`agora_core.world` reads the virtual clock, draws randomness from the seed and
opens endpoints on :class:`~agora_sim.network.SimNetwork`. The same scenario and seed
give the same :attr:`Simulation.trace` digest; run the process with a fixed
``PYTHONHASHSEED`` for it to hold across processes (set iteration order follows it).
"""

from __future__ import annotations

from agora_sim.hosts import SimHost, current_host
from agora_sim.links import LinkModel
from agora_sim.loop import SimulationStalled, VirtualClock, VirtualLoop
from agora_sim.network import SimNetwork
from agora_sim.simulation import Simulation
from agora_sim.trace import Trace

__all__ = [
    "LinkModel",
    "SimHost",
    "SimNetwork",
    "Simulation",
    "SimulationStalled",
    "Trace",
    "VirtualClock",
    "VirtualLoop",
    "current_host",
]
