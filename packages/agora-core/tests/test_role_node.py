"""RoleNode: the one way every role builds its key, metrics, RunNode, admission and watch."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from agora_core.admission.node_admission import NodeAdmission, OpenAdmission, cpu_hardware
from agora_core.config import NodeSettings
from agora_core.identity import NodeKey
from agora_core.injection import InjectionPoints, NodeEffects
from agora_core.node.role import RoleNode
from agora_core.observability.metrics import NodeMetrics
from agora_devkit.runs import tiny_run


def test_build_labels_its_metrics_and_serves_them_from_its_node():
    run, key = tiny_run("roles"), NodeKey.generate()
    member = RoleNode.build("worker", run, key, stage=1)
    assert member.metrics.labels["role"] == "worker"
    assert member.metrics.labels["stage"] == "1"
    assert member.metrics.labels["instance"] == key.node_id[:12]
    assert member.node.metrics is member.metrics and member.node.key is key
    assert isinstance(member.admission, OpenAdmission) and member.admission.valid

    async def serve_once() -> str:
        address = await member.node.start()
        await member.node.stop()
        return address

    assert asyncio.run(serve_once()).startswith("tcp://127.0.0.1:")
    assert b"agora_rpc" in member.metrics.exposition()  # the node's own counters, in its registry


def test_an_unknown_role_is_refused():
    with pytest.raises(ValueError, match="unknown role 'dht'"):
        RoleNode.build("dht", tiny_run("roles"), NodeKey.generate())


def test_a_given_member_must_be_the_roles_own():
    run, key = tiny_run("roles"), NodeKey.generate()
    member = RoleNode.build("trainer", run, key)
    assert RoleNode.given_or_built(member, "trainer", run, key) is member
    with pytest.raises(ValueError, match="takes the member's role, key and metrics"):
        RoleNode.given_or_built(member, "worker", run, key)
    with pytest.raises(ValueError, match="takes the member's role, key and metrics"):
        RoleNode.given_or_built(member, "trainer", run, NodeKey.generate())
    with pytest.raises(ValueError, match="takes the member's role, key and metrics"):
        RoleNode.given_or_built(member, "trainer", run, key, metrics=NodeMetrics(role="trainer"))
    built = RoleNode.given_or_built(None, "trainer", run, key, listen="127.0.0.1:0")
    assert built is not member and built.key is key


def test_from_settings_takes_the_nodes_address_and_link():
    run, key = tiny_run("roles"), NodeKey.generate()
    settings = NodeSettings(listen="127.0.0.1:0", advertise="127.0.0.1:7", link="latency=5ms")
    member = RoleNode.from_settings("trainer", run, key, settings, [])
    assert member.node.server._link is not None  # the emulated link the settings name
    assert member.node.dht._advertise == "127.0.0.1:7"


def test_an_authorized_admission_needs_an_authorized_run():
    run, key = tiny_run("roles"), NodeKey.generate()
    member = RoleNode.build("trainer", run, key)
    settings = NodeSettings(authorizer="127.0.0.1:9", account="acme")
    with pytest.raises(ValueError, match="for an authorized run"):
        member.ask_authorizer(settings, cpu_hardware())
    assert isinstance(member.admission, OpenAdmission)  # unchanged by the refusal
    authorized = dataclasses.replace(
        run,
        admission=dataclasses.replace(
            run.admission, mode="authorized", authorizer_public_key=NodeKey.generate().public_key.hex()
        ),
    )
    member = RoleNode.build("trainer", authorized, key, authorizer="127.0.0.1:9")
    admission = member.ask_authorizer(settings, cpu_hardware())
    assert isinstance(admission, NodeAdmission) and member.admission is admission
    assert admission.role == "trainer" and admission.node is member.node
    admission.close()


def test_the_injection_watch_is_the_members():
    run, key = tiny_run("roles"), NodeKey.generate()
    member = RoleNode.build("trainer", run, key)
    points = InjectionPoints()
    watcher = member.injection_watcher(stage=None, points=points, effects=NodeEffects())
    assert watcher.traits.role == "trainer" and watcher.traits.node_id == key.node_id
    assert watcher.metrics is member.metrics
    assert points.obey is not None
