"""Spot checks, the calls: a hop's question asked again of other replicas of its stage, and
what the trainer does with the answers (the rules are ``agora_trainer.spotcheck``).

A check asks one other replica, picked at random among those whose pair with the hop's worker
was checked least, distrusted ones included (a check's answer is never used unless two
replicas agree on it). While the stage's tolerance is unknown, a third replica is asked too
and every pair is measured. Past it, a mismatch goes to a third replica; a replica that
stands apart from an agreeing pair is distrusted for ``distrust_s``, logged, counted, and
after ``accuse_after`` such checks accused. When it was the hop's own worker, :meth:`check`
returns the agreeing replica and its answer, for the microbatch to go on with instead.
"""

from __future__ import annotations

from agora_core.errors import RpcError
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient
from agora_trainer.balancer import StageBalancer, WorkerRef
from agora_trainer.spotcheck import KINDS, Outputs, SpotCheckConfig, SpotChecker, distance

log = get_logger("trainer.checking")


class SpotChecks:
    def __init__(
        self,
        client: RpcClient,
        balancers: list[StageBalancer],
        config: SpotCheckConfig,
        metrics: NodeMetrics,
        *,
        node_id: str,
        request_timeout_s: float,
        distrust_s: float,
    ):
        """``node_id``: the trainer's, for its accusations; ``distrust_s``: how long a replica
        that stood apart gets no new microbatch."""
        self._client = client
        self._balancers = balancers
        self._timeout_s = request_timeout_s
        self._distrust_s = distrust_s
        self.rules = SpotChecker(config, len(balancers), node_id=node_id)
        self.mismatches = self.unresolved = 0
        self._m_checks = metrics.counter(
            "agora_trainer_spot_checks_total",
            "Hops asked again of another replica, by kind (forward, gradient) and outcome "
            "(learning: the tolerance not known yet, agreed, mismatch: one replica stood apart, "
            "unresolved: no third replica settled it, skipped: no second replica answered).",
            ["to_stage", "kind", "outcome"],
        )
        self._m_tolerance = metrics.gauge(
            "agora_trainer_spot_check_tolerance",
            "The relative distance two replicas' answers may stand apart and agree.",
            ["to_stage", "kind"],
        )

    @property
    def made(self) -> int:
        """Checks made (a second replica answered): each has its number."""
        return self.rules.serial

    def due(self, kind: str) -> bool:
        return self.rules.due(kind)

    async def _ask(
        self,
        stage: int,
        kind: str,
        method: str,
        request: dict,
        keys: tuple[str, ...],
        primary: str,
        exclude: set[str],
    ) -> tuple[WorkerRef, Outputs] | None:
        """``request`` asked of another replica of ``stage`` than ``primary`` and ``exclude``:
        (its ref, its answer's ``keys``), or None when there is none or it did not answer in
        full (a check is never retried)."""
        balancer = self._balancers[stage]
        samples = request["tokens"].shape[0]
        worker = self.rules.pick(
            stage, kind, primary, balancer.checkers(samples, frozenset({primary, *exclude}))
        )
        if worker is None:
            return None
        token = balancer.begin(worker)
        try:
            reply = await self._client.call(
                worker.address, method, {"stage": stage}, request, timeout_s=self._timeout_s
            )
        except RpcError:
            balancer.fail(token)
            return None
        balancer.complete(token, samples, 0.0)  # its time is no measure of its throughput
        if not all(key in reply.tensors for key in keys):
            return None
        return worker, {key: reply.tensors[key] for key in keys}

    async def check(
        self, kind: str, stage: int, method: str, request: dict, primary: WorkerRef, answer: Outputs
    ) -> tuple[WorkerRef, Outputs] | None:
        """Check ``primary``'s ``answer`` to ``request`` (asked again as ``method``); the
        agreeing replica and its answer when ``primary`` stood apart, else None."""
        if kind not in KINDS:
            raise ValueError(f"a spot check is one of {KINDS}, not {kind!r}")
        rules, keys = self.rules, tuple(answer)
        outcome = self._m_checks.labels
        asked = await self._ask(stage, kind, method, request, keys, primary.node_id, set())
        if asked is None:
            outcome(to_stage=str(stage), kind=kind, outcome="skipped").inc()
            return None
        checker, checked = asked
        check = rules.next_serial()
        tolerance = rules.tolerance(stage, kind)
        if tolerance is None:  # still learning how far apart honest replicas stand: ask a third
            answers = {primary.node_id: answer, checker.node_id: checked}
            third = await self._ask(stage, kind, method, request, keys, primary.node_id, {checker.node_id})
            if third is not None:
                answers[third[0].node_id] = third[1]
            ids = sorted(answers)
            for i, a in enumerate(ids):
                for b in ids[i + 1 :]:
                    rules.measured(stage, kind, a, b, distance(answers[a], answers[b]))
            outcome(to_stage=str(stage), kind=kind, outcome="learning").inc()
            return None
        self._m_tolerance.labels(to_stage=str(stage), kind=kind).set(tolerance)
        measured = distance(answer, checked)
        if measured <= tolerance:
            rules.measured(stage, kind, primary.node_id, checker.node_id, measured)
            outcome(to_stage=str(stage), kind=kind, outcome="agreed").inc()
            return None
        third = await self._ask(stage, kind, method, request, keys, primary.node_id, {checker.node_id})
        mismatch = None
        if third is not None:
            answers = {primary.node_id: answer, checker.node_id: checked, third[0].node_id: third[1]}
            mismatch = rules.settle(stage, kind, check, answers, tolerance)
        if mismatch is None:
            rules.measured(stage, kind, primary.node_id, checker.node_id, measured)
            self.unresolved += 1
            outcome(to_stage=str(stage), kind=kind, outcome="unresolved").inc()
            log.warning(
                "spot_check_unresolved",
                stage=stage,
                kind=kind,
                node=primary.node_id,
                checker=checker.node_id,
                distance=round(measured, 4),
                tolerance=round(tolerance, 4),
                third=third is not None,
            )
            return None
        self.mismatches += 1
        outcome(to_stage=str(stage), kind=kind, outcome="mismatch").inc()
        self._balancers[stage].distrust(mismatch.odd, self._distrust_s)
        served = mismatch.odd == primary.node_id
        log.warning(
            "spot_check_mismatch",
            stage=stage,
            kind=kind,
            node=mismatch.odd,
            check=check,
            distance=round(mismatch.evidence.measured, 4),
            agreed=round(mismatch.evidence.agreed, 4),
            tolerance=round(tolerance, 4),
            served=served,
            distrust_s=self._distrust_s,
        )
        if rules.failed(mismatch):
            log.warning(
                "spot_check_accused", stage=stage, node=mismatch.odd, failed=rules.failures(mismatch.odd)
            )
        if not served:
            return None
        return checker, checked  # the checker agreed with the third: it is the pair's
