"""The simulator's loop and network: virtual time, link delays, faults, as the RPC layer sees them."""

from __future__ import annotations

import asyncio
import time

import pytest

from agora_core import world
from agora_core.errors import DeadlineExceeded, PeerUnreachable
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_sim import LinkModel, Simulation, SimulationStalled


def echo_pair(sim: Simulation, server_link: LinkModel, client_link: LinkModel):
    """An echo server and a client, each on a host of its own."""
    server_host = sim.network.add_host("server", server_link)
    client_host = sim.network.add_host("client", client_link)
    with server_host.active():
        server = RpcServer()
        server.register("echo", lambda request: Payload(request.meta, request.tensors))
        sim.run(server.start())
    with client_host.active():
        client = RpcClient()
    return server, client, server_host, client_host


def timed_call(sim: Simulation, client: RpcClient, host, *args, **kwargs):
    async def call():
        started = world.monotonic()
        reply = await client.call(*args, **kwargs)
        return reply, world.monotonic() - started

    with host.active():
        return sim.run(call())


def test_an_hour_of_sleep_passes_in_virtual_time_and_the_real_clock_returns_after():
    real_started = time.monotonic()
    with Simulation(seed=1) as sim:
        before = world.monotonic()
        sim.run(asyncio.sleep(3600.0))
        assert world.monotonic() - before == pytest.approx(3600.0)
        assert sim.elapsed_s == pytest.approx(3600.0)
        assert world.simulated()
    assert time.monotonic() - real_started < 30.0
    assert world.monotonic is time.monotonic and world.wall is time.time
    assert not world.simulated()


def test_a_wait_for_something_that_never_comes_is_reported_as_stalled():
    with Simulation(seed=1) as sim:
        never = sim.loop.create_future()
        with pytest.raises(SimulationStalled):
            sim.run(never)


def test_a_call_costs_a_connection_round_trip_then_one_round_trip_each():
    with Simulation(seed=1) as sim:
        server, client, _, client_host = echo_pair(sim, LinkModel(latency_s=0.05), LinkModel(latency_s=0.03))
        round_trip_s = 2 * (0.05 + 0.03)
        first, first_s = timed_call(sim, client, client_host, server.address, "echo", {"n": 1})
        second, second_s = timed_call(sim, client, client_host, server.address, "echo", {"n": 2})
        assert (first.meta, second.meta) == ({"n": 1}, {"n": 2})
        assert first_s == pytest.approx(2 * round_trip_s, abs=1e-6)  # connect, then the call
        assert second_s == pytest.approx(round_trip_s, abs=1e-6)
        with client_host.active():
            sim.run(client.close())


def test_a_large_message_pays_the_slower_pipe_of_its_path():
    import numpy as np

    with Simulation(seed=1) as sim:
        server, client, _, client_host = echo_pair(
            sim,
            LinkModel(up_bits_per_s=800e6, down_bits_per_s=800e6),
            LinkModel(up_bits_per_s=8e6, down_bits_per_s=80e6),  # 1 MB up: 1 s; back down: 0.1 s
        )
        timed_call(sim, client, client_host, server.address, "echo", {})  # connected
        payload = {"x": np.random.default_rng(0).random(1_000_000 // 4, dtype=np.float32)}  # incompressible
        reply, elapsed_s = timed_call(sim, client, client_host, server.address, "echo", {}, payload)
        assert np.array_equal(reply.tensors["x"], payload["x"])
        # up 1 s + the server's down 0.01 s, then the reply: the server's up 0.01 s + down 0.1 s
        assert 1.1 < elapsed_s < 1.2


def test_a_tcp_window_caps_a_bulk_transfer_on_a_long_path_and_costs_a_small_message_nothing():
    import numpy as np

    window, one_way = 64 * 1024, 0.05  # each end's share: a round trip of 0.2 s
    fast = dict(up_bits_per_s=800e6, down_bits_per_s=800e6, latency_s=one_way)
    payload = {"x": np.random.default_rng(0).random(1_000_000 // 4, dtype=np.float32)}  # incompressible
    elapsed = {}
    for name, window_bytes in (("unlimited", None), ("windowed", window)):
        with Simulation(seed=1) as sim:
            server, client, _, client_host = echo_pair(
                sim, LinkModel(**fast, window_bytes=window_bytes), LinkModel(**fast)
            )
            timed_call(sim, client, client_host, server.address, "echo", {})  # connected
            _, small_s = timed_call(sim, client, client_host, server.address, "echo", {"n": 1})
            assert small_s == pytest.approx(0.2, abs=1e-3)  # a message inside the window pays no wait
            reply, elapsed[name] = timed_call(sim, client, client_host, server.address, "echo", {}, payload)
            assert np.array_equal(reply.tensors["x"], payload["x"])
            with client_host.active():
                sim.run(client.close())
    # Unlimited: a round trip plus 1 MB through 800 Mbit pipes each way.
    assert elapsed["unlimited"] < 0.25
    # Windowed: past the first window, each way moves at a window per round trip.
    per_way_s = (1_000_000 / window - 1) * 0.2 + 0.1
    assert elapsed["windowed"] == pytest.approx(2 * per_way_s, rel=0.05)


def test_a_window_must_be_positive():
    import random

    from agora_sim.dht_swarm import LinkRange

    with pytest.raises(ValueError, match="window_bytes"):
        LinkModel(window_bytes=0)
    with pytest.raises(ValueError, match="window_kb"):
        LinkRange(window_kb=-1.0)
    assert LinkRange(window_kb=64).draw(random.Random(0)).window_bytes == 65536


def test_a_partition_times_calls_out_and_healing_it_lets_them_through():
    with Simulation(seed=1) as sim:
        server, client, server_host, client_host = echo_pair(
            sim, LinkModel(latency_s=0.01), LinkModel(latency_s=0.01)
        )
        timed_call(sim, client, client_host, server.address, "echo", {})
        sim.network.partition([[server_host], [client_host]])
        with pytest.raises(DeadlineExceeded):
            timed_call(sim, client, client_host, server.address, "echo", {}, timeout_s=2.0)
        sim.network.heal()
        reply, elapsed_s = timed_call(sim, client, client_host, server.address, "echo", {"back": True})
        assert reply.meta == {"back": True} and elapsed_s == pytest.approx(0.04, abs=1e-6)
        assert sim.trace.dropped >= 1


def test_killing_a_host_fails_calls_waiting_on_it_and_cancels_its_tasks():
    with Simulation(seed=1) as sim:
        server_host = sim.network.add_host("server", LinkModel(latency_s=0.02))
        client_host = sim.network.add_host("client", LinkModel(latency_s=0.02))
        with server_host.active():
            server = RpcServer()

            async def slow(request):
                await asyncio.sleep(3600.0)

            server.register("slow", slow)
            sim.run(server.start())
            ticker = sim.loop.create_task(asyncio.sleep(3600.0))
        with client_host.active():
            client = RpcClient()
            call = sim.loop.create_task(client.call(server.address, "slow", timeout_s=60.0))
        sim.run_for(1.0)
        assert not call.done()
        sim.network.kill(server_host)
        sim.run_for(0.1)
        assert ticker.cancelled()
        assert isinstance(call.exception(), PeerUnreachable)
        assert sim.elapsed_s < 2.0  # heard within a one-way latency, not at the deadline


def test_dialing_a_live_host_where_nothing_listens_is_refused_after_one_round_trip():
    with Simulation(seed=1) as sim:
        empty = sim.network.add_host("empty", LinkModel(latency_s=0.05))
        client_host = sim.network.add_host("client", LinkModel(latency_s=0.05))
        with client_host.active():
            client = RpcClient()
        started = sim.elapsed_s
        with pytest.raises(PeerUnreachable, match="refused"):
            timed_call(sim, client, client_host, f"tcp://{empty.ip}:7001", "echo", {}, timeout_s=10.0)
        assert sim.elapsed_s - started == pytest.approx(0.2, abs=0.02)


def test_jitter_never_reorders_the_messages_of_one_connection():
    with Simulation(seed=3) as sim:
        server_host = sim.network.add_host("server", LinkModel(latency_s=0.05, jitter_s=0.04))
        client_host = sim.network.add_host("client", LinkModel(latency_s=0.05, jitter_s=0.04))
        seen: list[int] = []
        with server_host.active():
            server = RpcServer()
            server.register("note", lambda request: seen.append(request.meta))
            sim.run(server.start())
        with client_host.active():
            client = RpcClient()

            async def burst():
                await client.connect(server.address)
                await asyncio.gather(*(client.call(server.address, "note", i) for i in range(50)))

            sim.run(burst())
        assert seen == list(range(50))


def secured_echo(sim: Simulation, authority, server_host, *, access=None):
    """An authorized run's echo server on ``server_host``: it answers with the caller it saw."""
    from agora_core.identity import NodeKey

    key = NodeKey.generate()
    with server_host.active():
        server = RpcServer(security=authority.security(key, authority.credential(key)), node_id=key.node_id)
        server.register(
            "echo",
            lambda request: Payload({"sender": request.sender}),
            **({} if access is None else {"access": access}),
        )
        sim.run(server.start())
    return server, key


def secured_client(authority, host, credential: bool = True, **credential_fields):
    from agora_core.identity import NodeKey

    key = NodeKey.generate()
    held = authority.credential(key, **credential_fields) if credential else None
    with host.active():
        return RpcClient(security=authority.security(key, held), node_id=key.node_id), key


def test_an_authorized_call_pays_the_curve_handshake_and_names_the_authenticated_caller():
    from agora_devkit.authority import TestAuthority

    authority = TestAuthority()
    with Simulation(seed=1) as sim:
        server_host = sim.network.add_host("server", LinkModel(latency_s=0.05))
        client_host = sim.network.add_host("client", LinkModel(latency_s=0.05))
        server, server_key = secured_echo(sim, authority, server_host)
        client, caller = secured_client(authority, client_host)
        client.security.expect(server.address, server_key.public_key)
        round_trip_s = 0.2
        reply, first_s = timed_call(sim, client, client_host, server.address, "echo", {})
        assert reply.meta == {"sender": caller.node_id}  # the key it proved, not a claim
        # TCP, then CURVE's two round trips, then the greeting (credentials), then the call
        assert first_s == pytest.approx(5 * round_trip_s, abs=1e-3)
        _, second_s = timed_call(sim, client, client_host, server.address, "echo", {})
        assert second_s == pytest.approx(round_trip_s, abs=1e-3)
        with client_host.active():
            sim.run(client.close())


def test_an_authorized_server_refuses_the_wrong_key_an_open_client_and_a_caller_it_does_not_serve():
    from agora_core.auth.access import only
    from agora_core.errors import Forbidden, PeerRefused
    from agora_core.identity import NodeKey
    from agora_devkit.authority import TestAuthority

    authority = TestAuthority()
    with Simulation(seed=1) as sim:
        server_host = sim.network.add_host("server", LinkModel(latency_s=0.01))
        client_host = sim.network.add_host("client", LinkModel(latency_s=0.01))
        server, server_key = secured_echo(sim, authority, server_host, access=only(("worker",), stage=1))
        impostor_expected, _ = secured_client(authority, client_host, stage=1)
        impostor_expected.security.expect(server.address, NodeKey.generate().public_key)
        with pytest.raises(PeerRefused, match="does not hold the key"):
            timed_call(sim, impostor_expected, client_host, server.address, "echo", {}, timeout_s=5.0)
        with client_host.active():
            open_client = RpcClient()
        with pytest.raises(PeerUnreachable):  # an open client meets a secured server
            timed_call(sim, open_client, client_host, server.address, "echo", {}, timeout_s=5.0)
        uncredentialed, _ = secured_client(authority, client_host, credential=False)
        uncredentialed.security.expect(server.address, server_key.public_key)
        with pytest.raises(PeerRefused):
            timed_call(sim, uncredentialed, client_host, server.address, "echo", {}, timeout_s=5.0)
        other_stage, _ = secured_client(authority, client_host, stage=0)
        other_stage.security.expect(server.address, server_key.public_key)
        with pytest.raises(Forbidden):
            timed_call(sim, other_stage, client_host, server.address, "echo", {}, timeout_s=5.0)
        allowed, caller = secured_client(authority, client_host, stage=1)
        allowed.security.expect(server.address, server_key.public_key)
        reply, _ = timed_call(sim, allowed, client_host, server.address, "echo", {}, timeout_s=5.0)
        assert reply.meta == {"sender": caller.node_id}
        with client_host.active():
            for client in (impostor_expected, open_client, uncredentialed, other_stage, allowed):
                sim.run(client.close())


def test_a_host_reads_its_own_skewed_wall_clock():
    with Simulation(seed=1) as sim:
        ahead = sim.network.add_host("ahead")
        ahead.skew_s = 12.5
        plain = world.wall()
        with ahead.active():
            assert world.wall() - plain == pytest.approx(12.5)
        assert world.wall() == pytest.approx(plain)
