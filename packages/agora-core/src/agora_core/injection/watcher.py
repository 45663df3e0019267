"""A node's watch on the operator's injection records: read, check, arm or schedule, obey once.

Every ``[operator] injection_watch_s`` the node reads :func:`injections_key` with the DHT's
ordinary get (one request to each of the key's replicas). A record already looked at (same
subkey, same expiration) is skipped unparsed, so a re-read costs one get and a dict lookup
per record. A new one is parsed, its writer checked (``OperatorKeys``), and its targets
matched against this node; then a timed trigger is scheduled on the event loop and any
other is armed on the node's :class:`InjectionPoints`, until its record expires.

A record is obeyed at most once per node: its id is remembered (``obeyed``), so re-reads,
a copy with a later expiration or a record rewritten under the same id change nothing.
Every obeyed injection is counted (``agora_injections_obeyed_total{record,action}``) and
logged (``injection_obeyed``, with its record id) before it acts. Records this node will not
obey are counted by reason (``agora_injections_ignored_total{reason}``), once per record.
"""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

from agora_core import world
from agora_core.dht import DhtError, DhtNode, DhtValue
from agora_core.errors import RpcError
from agora_core.injection.effects import NodeEffects
from agora_core.injection.operators import OperatorKeys
from agora_core.injection.points import NO_INJECTIONS, InjectionPoints
from agora_core.injection.record import Injection, InjectionRejected, NodeTraits, injections_key
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics

if TYPE_CHECKING:
    from agora_core.config import RunConfig
    from agora_core.node.run_node import RunNode

log = get_logger("injection")

REMEMBERED = 4096  # record ids (and looked-at copies) a node keeps: far more than live at once


class InjectionWatcher:
    def __init__(
        self,
        *,
        dht: DhtNode,
        run_name: str,
        interval_s: float,
        operators: OperatorKeys,
        role: str,
        stage: int | None,
        points: InjectionPoints,
        effects: NodeEffects,
        metrics: NodeMetrics,
    ):
        """``interval_s`` 0: the watcher never reads (a run that takes no injections);
        ``points``: the node's own (never the shared, disarmed NO_INJECTIONS)."""
        if points is NO_INJECTIONS:
            raise ValueError("a watcher arms the node's own InjectionPoints, not NO_INJECTIONS")
        self._dht = dht
        self.key = injections_key(run_name)
        self.interval_s = interval_s
        self._operators = operators
        self.traits = NodeTraits(node_id=dht.node_id, role=role, stage=stage, started=world.wall())
        self.points = points
        self._effects = effects
        self.metrics = metrics
        points.obey = self._obey
        self._seen: collections.OrderedDict[tuple[str, float], None] = collections.OrderedDict()
        self.obeyed: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> action
        self._scheduled: dict[str, asyncio.TimerHandle] = {}
        self._task: asyncio.Task | None = None
        self._m_obeyed = metrics.counter(
            "agora_injections_obeyed_total", "Injected failures this node obeyed.", ["record", "action"]
        )
        self._m_ignored = metrics.counter(
            "agora_injections_ignored_total", "Injection records this node refused, by reason.", ["reason"]
        )
        self._m_armed = metrics.gauge("agora_injections_armed", "Injections waiting for their trigger here.")

    @classmethod
    def for_node(
        cls,
        node: RunNode,
        run: RunConfig,
        *,
        role: str,
        stage: int | None,
        points: InjectionPoints,
        effects: NodeEffects,
    ) -> InjectionWatcher:
        """The watcher of a role's ``node`` in ``run``: its DHT, its run's operators (an
        authorized run's through its transport's credential checks), its metrics."""
        verifier = None if node.security is None else node.security.verifier
        if effects.drop_link is None:
            effects.drop_link = node.drop_link
        return cls(
            dht=node.dht,
            run_name=run.name,
            interval_s=run.operator.injection_watch_s,
            operators=OperatorKeys(run.operator, verifier),
            role=role,
            stage=stage,
            points=points,
            effects=effects,
            metrics=node.metrics,
        )

    def set_stage(self, stage: int | None) -> None:
        """The node's stage, once known (an authorized worker learns it from the authorizer)."""
        self.traits = NodeTraits(
            node_id=self.traits.node_id, role=self.traits.role, stage=stage, started=self.traits.started
        )

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Read the records once now (a joiner's download trigger must be armed before its
        download begins), then every ``interval_s`` in the background."""
        if self.interval_s <= 0:
            return
        await self.poll()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="injection-watch")

    async def stop(self) -> None:
        for handle in self._scheduled.values():
            handle.cancel()
        self._scheduled.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    # --- reading --------------------------------------------------------------------------------

    async def poll(self) -> None:
        """One read of the records; errors are logged and the next read tries again."""
        try:
            found = await self._dht.get(self.key)
        except (DhtError, RpcError) as exc:
            log.debug("injection_read_failed", error=str(exc))
            return
        now = world.wall()
        for subkey, value in found.items():
            marker = (subkey, value.expiration)
            if marker in self._seen:
                continue
            _remember(self._seen, marker, None)
            self._consider(subkey, value, now)
        for injection in self.points.expire(now):
            log.info("injection_expired", record=injection.id, trigger=str(injection.trigger))
        self._m_armed.set(len(self.points.waiting()))

    def _consider(self, subkey: str, found: DhtValue, now: float) -> None:
        try:
            injection = Injection.from_value(found.value)
            self._operators.check(subkey, found, injection)
        except InjectionRejected as exc:
            self._m_ignored.labels(reason=exc.reason).inc()
            log.warning("injection_ignored", subkey=subkey[:100], reason=exc.reason, detail=str(exc))
            return
        except Exception as exc:  # a reader bug must not take the node down with it
            self._m_ignored.labels(reason="malformed").inc()
            log.exception("injection_unreadable", subkey=subkey[:100], error=str(exc))
            return
        if injection.id in self.obeyed or injection.id in self._scheduled or self._is_armed(injection.id):
            return  # the same record again (refreshed, or rewritten under its id)
        if injection.expires <= now:
            self._m_ignored.labels(reason="expired").inc()
            return
        if not injection.targets.selects(injection.id, injection.issued, self.traits):
            log.debug("injection_not_for_me", record=injection.id)
            return
        if injection.trigger.timed:
            delay_s = max(0.0, injection.fires_at() - now)
            if delay_s <= 0:
                self._obey(injection, str(injection.trigger))
                return
            loop = asyncio.get_running_loop()
            self._scheduled[injection.id] = loop.call_later(delay_s, self._fire_scheduled, injection)
            log.info(
                "injection_scheduled", record=injection.id, in_s=round(delay_s, 3), what=injection.describe()
            )
            return
        self.points.arm(injection)
        self._m_armed.set(len(self.points.waiting()))
        log.info("injection_armed", record=injection.id, what=injection.describe())

    def _is_armed(self, record_id: str) -> bool:
        return any(injection.id == record_id for injection in self.points.waiting())

    def _fire_scheduled(self, injection: Injection) -> None:
        self._scheduled.pop(injection.id, None)
        if world.wall() < injection.expires:
            self._obey(injection, str(injection.trigger))

    # --- obeying --------------------------------------------------------------------------------

    def _obey(self, injection: Injection, where: str) -> None:
        """Count, log, act: at most once per record id."""
        if injection.id in self.obeyed:
            return
        _remember(self.obeyed, injection.id, str(injection.action))
        self._m_obeyed.labels(record=injection.id, action=str(injection.action)).inc()
        self._m_armed.set(len(self.points.waiting()))
        log.warning(
            "injection_obeyed",
            record=injection.id,
            action=str(injection.action),
            trigger=where,
            node=self.traits.node_id[:12],
            role=self.traits.role,
            stage=self.traits.stage,
            what=injection.describe(),
        )
        try:
            self._effects.apply(injection)
        except Exception:  # an effect that fails must not take the code path it fired in with it
            log.exception("injection_failed", record=injection.id, action=str(injection.action))

    def info(self) -> dict:
        """What ``worker.info`` (and tools) say about injections here."""
        return {
            "watching": self._task is not None,
            "armed": sorted(injection.id for injection in self.points.waiting()),
            "scheduled": sorted(self._scheduled),
            "obeyed": list(self.obeyed),
        }


def _remember(memory: collections.OrderedDict, key, value) -> None:
    memory[key] = value
    while len(memory) > REMEMBERED:
        memory.popitem(last=False)
