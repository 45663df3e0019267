"""The real DHT in the simulator: it converges, serves, detects deaths, and replays exactly."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

from agora_core.config.run import DhtConfig
from agora_core.contract import Method
from agora_core.dht import DhtNode
from agora_core.errors import PeerUnreachable, RpcError
from agora_core.rpc import RpcClient
from agora_sim import Simulation
from agora_sim.dht_swarm import LinkRange, SimDhtSwarm

REPO = Path(__file__).resolve().parents[3]

SCRIPT = """
import sys
from agora_sim import Simulation
from agora_sim.dht_swarm import SimDhtSwarm
with Simulation(seed=int(sys.argv[1])) as sim:
    swarm = SimDhtSwarm(sim)
    swarm.add(24)
    swarm.run_until(swarm.converged, limit_s=60.0)
    swarm.measure_ops(10)
    swarm.kill(swarm.nodes[5])
    sim.run_for(20.0)
    print(sim.digest(), sim.trace.messages)
"""


def run_scenario(seed: int, members: int = 24):
    with Simulation(seed=seed) as sim:
        swarm = SimDhtSwarm(sim, links=LinkRange(), config=DhtConfig())
        swarm.add(members)
        joined_s = swarm.run_until(swarm.converged, limit_s=60.0)
        stores, gets = swarm.measure_ops(10)
        victim = swarm.nodes[5]
        swarm.kill(victim)
        gone_s = swarm.run_until(
            lambda: all(victim.node_id not in n.live_ids() for n in swarm.live_nodes()), limit_s=60.0
        )
        digest = sim.digest()
        swarm.stop()
        return joined_s, stores, gets, gone_s, digest


def test_a_simulated_dht_converges_serves_and_finds_a_dead_member_in_virtual_time():
    real_started = time.monotonic()
    joined_s, stores, gets, gone_s, _ = run_scenario(seed=11)
    assert joined_s is not None
    assert len(gets) == 10
    # one hop each: a get waits for replicas one round trip away (at most 2 x (37.5 + 37.5) ms
    # plus jitter and the hedge), never for a timeout
    assert max(gets) < 0.5 and max(stores) < 0.5
    config = DhtConfig()
    assert gone_s is not None and gone_s <= config.suspicion_timeout_s + 5 * config.gossip_period_s
    assert time.monotonic() - real_started < 60.0


def test_the_same_seed_replays_the_same_trace_and_another_seed_does_not():
    first = run_scenario(seed=5)
    second = run_scenario(seed=5)
    other = run_scenario(seed=6)
    assert first == second
    assert other[-1] != first[-1]


def test_a_fixed_hash_seed_replays_the_trace_across_processes():
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    digests = {
        subprocess.run(
            [sys.executable, "-c", SCRIPT, "3"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout.split()[0]
        for _ in range(2)
    }
    assert len(digests) == 1


def run_authorized(seed: int, members: int = 12):
    with Simulation(seed=seed) as sim:
        swarm = SimDhtSwarm(sim, links=LinkRange(), config=DhtConfig(), authorized=True)
        swarm.add(members)
        joined_s = swarm.run_until(swarm.converged, limit_s=60.0)
        _, gets = swarm.measure_ops(5)
        digest = sim.digest()
        outsider = sim.network.add_host("outsider")
        with outsider.active():
            client = RpcClient()  # no credential, no key: an open run's client

            async def ask():
                try:
                    await client.call(swarm.nodes[0].address, Method.DHT_MEMBERS, {}, timeout_s=5.0)
                except RpcError as exc:
                    return exc
                finally:
                    await client.close()

            refusal = sim.run(ask())
        swarm.stop()
        return joined_s, gets, digest, refusal


def test_an_authorized_dht_converges_and_serves_over_curve_refuses_outsiders_and_replays():
    joined_s, gets, digest, refusal = run_authorized(seed=3)
    assert joined_s is not None and len(gets) == 5
    assert isinstance(refusal, PeerUnreachable), refusal  # served nothing
    assert run_authorized(seed=3)[2] == digest  # credentials and keys come from the seed too


def test_a_member_restarted_on_a_clock_behind_its_previous_life_rejoins_above_it():
    with Simulation(seed=21) as sim:
        swarm = SimDhtSwarm(sim)
        swarm.add(8)
        assert swarm.run_until(swarm.converged, limit_s=60.0) is not None
        old = swarm.nodes[3]
        held_at = old.table.me.incarnation
        swarm.kill(old)
        gone = lambda: all(old.node_id not in n.live_ids() for n in swarm.live_nodes())  # noqa: E731
        assert swarm.run_until(gone, limit_s=60.0) is not None  # a tombstone at held_at everywhere
        # The same key restarts on a machine whose clock is five minutes behind: its first
        # claim (wall-clock milliseconds) is below the incarnation its id is held dead at.
        host = sim.network.add_host("restarted", LinkRange().draw(sim.rng()))
        host.skew_s = -300.0
        with host.active():
            again = DhtNode(key=old.key, config=swarm.config, bootstrap=[swarm.nodes[0].address])
            sim.run(again.start())  # joined: the member answered with held_at, it claimed above
        assert again.table.me.incarnation > held_at
        back = lambda: all(  # noqa: E731
            again.node_id in n.live_ids() and n.table.get(again.node_id).address == again.address
            for n in swarm.live_nodes()
        )
        assert swarm.run_until(back, limit_s=60.0) is not None  # alive again in every view
        with host.active():
            sim.run(again.stop(leave=False))
        swarm.stop()


def test_members_started_together_probe_at_phases_spread_over_the_period():
    """Each detector starts its cadence at a random phase: members started at one instant (a
    swarm brought up at once, many nodes in one process) must not all probe in one burst."""
    config = DhtConfig()
    with Simulation(seed=5) as sim:
        swarm = SimDhtSwarm(sim, config=config)
        swarm.add(16)
        assert swarm.run_until(swarm.converged, limit_s=60.0) is not None
        phases: dict[str, float] = {}
        counts = {n.node_id: n.gossip.detector.probes for n in swarm.nodes}
        step_s = config.gossip_period_s / 100
        for _ in range(200):  # two periods: every member probes in each
            sim.run_for(step_s)
            for node in swarm.nodes:
                probes = node.gossip.detector.probes
                if probes != counts[node.node_id] and node.node_id not in phases:
                    phases[node.node_id] = sim.elapsed_s % config.gossip_period_s
                counts[node.node_id] = probes
        swarm.stop()
    assert len(phases) == 16
    ordered = sorted(phases.values())
    gaps = [b - a for a, b in itertools.pairwise(ordered)] + [
        ordered[0] + config.gossip_period_s - ordered[-1]
    ]
    # one burst leaves most of the period empty; 16 random phases leave no gap near half of it
    assert max(gaps) < 0.5 * config.gossip_period_s, ordered
