"""The skeleton every role stands on.

A worker, a trainer, the authorizer and the monitor are each one member of the run: a node
key, a metrics registry labelled with the role, and a :class:`RunNode` (RPC server and client,
DHT member, transport security) built from the node's settings. A worker and a trainer also
hold an admission: an authorized run's :class:`NodeAdmission` (asks the authorizer, keeps the
credential fresh), an open run's :class:`OpenAdmission` (always valid). The authorizer is the
one issuing credentials and the monitor brings one issued offline, so theirs stay open.

:class:`RoleNode` builds those parts one way for all four roles; each role's own class
registers its handlers on the node and starts and stops it with itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from agora_core.admission.credential import SignedCredential
from agora_core.admission.join_client import JoinStatus
from agora_core.admission.join_request import HardwareReport
from agora_core.admission.node_admission import NodeAdmission, OpenAdmission
from agora_core.config import NodeSettings, RunConfig
from agora_core.identity import NodeKey
from agora_core.injection import InjectionPoints, InjectionWatcher, NodeEffects
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.linkemu import LinkEmulator

ROLES = ("worker", "trainer", "authorizer", "monitor")


@dataclasses.dataclass
class RoleNode:
    role: str
    run: RunConfig
    key: NodeKey
    metrics: NodeMetrics
    node: RunNode
    admission: NodeAdmission | OpenAdmission = dataclasses.field(default_factory=OpenAdmission)

    @classmethod
    def build(
        cls,
        role: str,
        run: RunConfig,
        key: NodeKey,
        *,
        stage: int | None = None,
        metrics: NodeMetrics | None = None,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        advertise: str | None = None,
        link: LinkEmulator | None = None,
        authorizer: str | None = None,
        credential: SignedCredential | None = None,
    ) -> RoleNode:
        """The member ``role`` runs on, not started; ``metrics`` (default: a new registry
        labelled with the role, ``stage`` and the key) serve its node's counters too."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
        metrics = metrics or NodeMetrics(role=role, stage=stage, instance=key.node_id[:12])
        node = RunNode(
            run=run,
            key=key,
            metrics=metrics,
            listen=listen,
            bootstrap=bootstrap,
            advertise=advertise,
            link=link,
            authorizer=authorizer,
            credential=credential,
        )
        return cls(role=role, run=run, key=key, metrics=metrics, node=node)

    @classmethod
    def given_or_built(
        cls,
        member: RoleNode | None,
        role: str,
        run: RunConfig,
        key: NodeKey,
        *,
        metrics: NodeMetrics | None = None,
        **build: Any,
    ) -> RoleNode:
        """A role class's member: ``member`` when its command built one (it must hold ``key``
        and bring its own metrics), else :meth:`build` from the class's arguments."""
        if member is None:
            return cls.build(role, run, key, metrics=metrics, **build)
        if member.role != role or member.key is not key or metrics is not None:
            raise ValueError(f"a {role} given its member takes the member's role, key and metrics")
        return member

    @classmethod
    def from_settings(
        cls,
        role: str,
        run: RunConfig,
        key: NodeKey,
        settings: NodeSettings,
        bootstrap: Sequence[str],
        *,
        stage: int | None = None,
        credential: SignedCredential | None = None,
    ) -> RoleNode:
        """The member a role's command runs on: listen, advertise, link and authorizer from
        the node's ``settings``."""
        return cls.build(
            role,
            run,
            key,
            stage=stage,
            listen=settings.listen,
            bootstrap=bootstrap,
            advertise=settings.advertise,
            link=settings.link_emulator(),
            authorizer=settings.authorizer,
            credential=credential,
        )

    def ask_authorizer(
        self,
        settings: NodeSettings,
        hardware: HardwareReport,
        *,
        matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul,
        on_status: Callable[[JoinStatus], None] | None = None,
    ) -> NodeAdmission:
        """Give this member an authorized run's admission (``settings``: the authorizer's
        address and the account; ``hardware``: what the node reports; ``matmul``: how it
        computes the challenge); it is submitted by whoever starts the role."""
        self.admission = NodeAdmission(
            run=self.run,
            node=self.node,
            key=self.key,
            role=self.role,
            settings=settings,
            hardware=hardware,
            matmul=matmul,
            on_status=on_status,
        )
        return self.admission

    def injection_watcher(
        self, *, stage: int | None, points: InjectionPoints, effects: NodeEffects
    ) -> InjectionWatcher:
        """The watch on the operator's injection records, firing ``effects`` at ``points``."""
        return InjectionWatcher.for_node(
            self.node, self.run, role=self.role, stage=stage, points=points, effects=effects
        )
