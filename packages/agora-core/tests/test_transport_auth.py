"""Authenticated transport in an authorized run: every connection is a CURVE session whose
both ends present a credential of the run, checked against the run's authorizer key.

The refusals are checked against a real DHT node process (``agora dht serve`` with an
operator credential, as a seed runs); the rest against servers in this process, on real
sockets on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest

from agora_core.admission.credential import SignedCredential
from agora_core.admission.revocations import Revocations, revocations_key
from agora_core.auth.access import only
from agora_core.contract import Method
from agora_core.dht import member_list, owned_subkey
from agora_core.errors import Forbidden, PeerRefused, RpcError, Unauthenticated
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, RpcClient, RpcServer
from agora_devkit.authority import TestAuthority
from agora_devkit.processes import poll_until


@contextlib.asynccontextmanager
async def client_of(
    authority: TestAuthority,
    key: NodeKey,
    held: SignedCredential | None,
    expect: tuple[str, bytes],
    **options,
):
    client = RpcClient(security=authority.security(key, held, **options), node_id=key.node_id)
    client.security.expect(*expect)
    try:
        yield client
    finally:
        await client.close()


async def test_peers_without_a_valid_credential_are_refused_at_connect(authority, seed):
    expect = (seed.address, seed.key.public_key)
    honest = NodeKey.generate()
    async with client_of(authority, honest, authority.credential(honest), expect) as client:
        reply = await client.call(seed.address, Method.DHT_MEMBERS, {}, timeout_s=5)
        assert len(member_list.unpack(reply.meta, reply.tensors)) >= 1  # the control: it is served
    thief = NodeKey.generate()
    cases = {
        "none": (NodeKey.generate(), None),
        "other_run": (other := NodeKey.generate(), authority.credential(other, run="another-run")),
        "expired": (late := NodeKey.generate(), authority.credential(late, lifetime_s=-60.0)),
        "wrong_key": (thief, authority.credential(honest)),  # a stolen credential, presented with another key
    }
    for why, (key, held) in cases.items():
        async with client_of(authority, key, held, expect) as client:
            with pytest.raises(PeerRefused) as refused:
                await client.connect(seed.address)
            assert why.replace("_", " ") in str(refused.value).replace("_", " ") or why == "none", (
                refused.value
            )
            with pytest.raises(PeerRefused):  # and at the handshake from then on
                await client.call(seed.address, Method.DHT_MEMBERS, {}, timeout_s=5)


async def test_a_server_that_is_not_the_node_expected_at_its_address_is_refused(authority, seed):
    key = NodeKey.generate()
    impersonated = NodeKey.generate()  # the member the caller believes is there
    async with client_of(
        authority, key, authority.credential(key), (seed.address, impersonated.public_key)
    ) as client:
        with pytest.raises(PeerRefused) as refused:
            await client.call(seed.address, Method.DHT_MEMBERS, {}, timeout_s=5)
        assert "does not hold the key" in str(refused.value)


async def test_a_revoked_peer_is_dropped_and_refused_once_the_list_reaches_the_node(authority, seed):
    key = NodeKey.generate()
    authorizer = RunNode(
        run=authority.run_config(),
        key=authority.key,
        metrics=NodeMetrics(role="authorizer"),
        bootstrap=[f"{seed.key.public_key.hex()}@{seed.address}"],
    )
    await authorizer.start()
    try:
        async with client_of(
            authority, key, authority.credential(key), (seed.address, seed.key.public_key)
        ) as client:
            await client.call(seed.address, Method.DHT_MEMBERS, {}, timeout_s=5)
            revoked = Revocations(nodes=(key.node_id,), updated=time.time())
            await authorizer.dht.store(
                revocations_key(authority.run),
                owned_subkey(authority.key.public_key),
                revoked.to_value(),
                time.time() + 60,
                signer=authority.key,
            )

            async def refused() -> bool:
                try:
                    await client.call(seed.address, Method.DHT_MEMBERS, {}, timeout_s=5)
                except Unauthenticated:
                    return True
                return False

            # the seed reads the list every status line (0.3 s here)
            await poll_until(refused, timeout_s=20, what="the revoked peer's calls refused")
        async with client_of(
            authority, key, authority.credential(key), (seed.address, seed.key.public_key)
        ) as again:
            with pytest.raises(PeerRefused):
                await again.connect(seed.address)
    finally:
        await authorizer.stop()


@contextlib.asynccontextmanager
async def echo_server(authority: TestAuthority, *, access=None, **options):
    key = NodeKey.generate()
    server = RpcServer(
        security=authority.security(key, authority.credential(key), **options), node_id=key.node_id
    )
    calls = []

    async def echo(request):
        calls.append(request.sender)
        return Payload({"sender": request.sender})

    server.register("echo", echo, **({} if access is None else {"access": access}))
    await server.start()
    try:
        yield server, key, calls
    finally:
        await server.stop()


async def test_the_sender_a_handler_sees_is_the_authenticated_node_not_the_claimed_one(authority):
    async with echo_server(authority) as (server, key, _calls):
        caller = NodeKey.generate()
        client = RpcClient(
            security=authority.security(caller, authority.credential(caller)), node_id="f" * 40
        )  # a lie
        client.security.expect(server.address, key.public_key)
        try:
            reply = await client.call(server.address, "echo", {})
            assert reply.meta["sender"] == caller.node_id
        finally:
            await client.close()


async def test_methods_serve_only_the_roles_and_stage_they_name(authority):
    async with echo_server(authority, access=only(("worker",), stage=1)) as (server, key, calls):
        for role, stage, allowed in (("worker", 1, True), ("worker", 0, False), ("trainer", None, False)):
            caller = NodeKey.generate()
            async with client_of(
                authority,
                caller,
                authority.credential(caller, role=role, stage=stage),
                (server.address, key.public_key),
            ) as c:
                if allowed:
                    await c.call(server.address, "echo", {})
                else:
                    with pytest.raises(Forbidden):
                        await c.call(server.address, "echo", {})
        assert len(calls) == 1


async def test_an_expiring_credential_ends_its_calls_unless_it_is_refreshed(authority):
    async with echo_server(authority, max_clock_skew_s=0.5, recheck_s=0.2) as (server, key, _calls):
        lapsing, renewing = NodeKey.generate(), NodeKey.generate()
        held = {"value": authority.credential(renewing, lifetime_s=2.0).to_value()}
        renewer_security = authority.security(renewing, None, max_clock_skew_s=0.5, recheck_s=0.2)
        renewer_security.credential = lambda: held["value"]
        renewer = RpcClient(security=renewer_security)
        renewer.security.expect(server.address, key.public_key)
        async with client_of(
            authority,
            lapsing,
            authority.credential(lapsing, lifetime_s=2.0),
            (server.address, key.public_key),
            max_clock_skew_s=0.5,
        ) as lapser:
            try:
                await lapser.call(server.address, "echo", {})
                await renewer.call(server.address, "echo", {})
                held["value"] = authority.credential(renewing, lifetime_s=60.0).to_value()
                renewer_security.credential_changed()  # the keeper got a new one: present it

                async def lapsed() -> bool:
                    try:
                        await lapser.call(server.address, "echo", {})
                    except Unauthenticated:
                        return True
                    return False

                await poll_until(lapsed, timeout_s=10, what="the lapsed credential's calls refused")
                await renewer.call(server.address, "echo", {})  # the refreshed one is still served
            finally:
                await renewer.close()


async def test_a_clock_beyond_the_runs_skew_limit_is_refused_with_a_clear_error(authority):
    async with echo_server(authority) as (server, key, calls):
        caller = NodeKey.generate()
        async with client_of(
            authority,
            caller,
            authority.credential(caller),
            (server.address, key.public_key),
            clock=lambda: time.time() + 120,
        ) as client:
            with pytest.raises(PeerRefused) as refused:
                await client.call(server.address, "echo", {})
        assert "clock is +120" in str(refused.value) and "limit of 10 s" in str(refused.value)
        assert calls == []


async def test_a_captured_session_replayed_on_another_connection_reaches_no_handler(authority):
    async with echo_server(authority) as (server, key, calls):
        host, port = server.address.removeprefix("tcp://").rsplit(":", 1)
        captured = bytearray()

        async def relay(reader, writer, sink: bytearray | None):
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    if sink is not None:
                        sink.extend(data)
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def proxy(client_reader, client_writer):
            server_reader, server_writer = await asyncio.open_connection(host, int(port))
            await asyncio.gather(
                relay(client_reader, server_writer, captured), relay(server_reader, client_writer, None)
            )

        tap = await asyncio.start_server(proxy, "127.0.0.1", 0)
        tapped = f"tcp://127.0.0.1:{tap.sockets[0].getsockname()[1]}"
        caller = NodeKey.generate()
        async with client_of(
            authority, caller, authority.credential(caller), (tapped, key.public_key)
        ) as client:
            for _ in range(3):
                await client.call(tapped, "echo", {"secret": "payload"})
        tap.close()
        assert len(calls) == 3 and b"payload" not in captured  # encrypted on the wire
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(bytes(captured))  # the whole session again, on a connection of its own
        await writer.drain()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(1.0):
                while await reader.read(65536):
                    pass
        writer.close()
        assert len(calls) == 3
        async with client_of(
            authority, caller, authority.credential(caller), (server.address, key.public_key)
        ) as client:
            await client.call(server.address, "echo", {})  # and the server still serves
        assert len(calls) == 4


async def test_an_open_client_cannot_talk_to_an_authorized_node_at_all(authority):
    async with echo_server(authority) as (server, _key, calls):
        client = RpcClient(config=dataclasses.replace(RpcClient().config, connect_timeout_s=1.0))
        try:
            with pytest.raises(RpcError):
                await client.call(server.address, "echo", {}, timeout_s=2)
        finally:
            await client.close()
        assert calls == []
