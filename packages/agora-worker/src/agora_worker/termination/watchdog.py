"""The watchdog: a worker task that evaluates the termination rules and, when one trips, departs.

Departing is what a worker does before it exits on its own: it stops serving (withdraws its
announcement for good, so trainers stop routing to it at once), and publishes a departure
record under its own signed subkey of ``<run>/stage/<s>/departures`` (reason, the measured
value and the threshold, its step, the time, its exit code) for a monitor to read, both within
a deadline. Then ``fired`` is set: the process leaves the DHT, stops and exits with
``exit_code`` (agora-worker's CLI does that; an embedding program awaits ``wait()``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from agora_core import world
from agora_core.config.lifecycle import TerminationConfig
from agora_core.contract import DepartureReason
from agora_core.dht import DhtError, DhtNode
from agora_core.dht.owned import OwnedEntry
from agora_core.errors import RpcError
from agora_core.identity import NodeKey
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.schema import WorkerDeparture, stage_departures_key
from agora_worker.termination.rules import (
    AveragingFailures,
    CredentialLost,
    HostMemory,
    InARow,
    NoProgress,
    Rule,
    Unreachable,
    Verdict,
)

if TYPE_CHECKING:
    from agora_worker.worker import Worker

log = get_logger("worker.termination")


class Watchdog:
    def __init__(
        self,
        *,
        rules: Sequence[Rule],
        interval_s: float,
        dht: DhtNode,
        key: NodeKey,
        run_name: str,
        stage: int,
        step: Callable[[], int],
        retire: Callable[[], Awaitable[None]],
        departure_ttl_s: float,
        timeout_s: float,
        metrics: NodeMetrics,
    ):
        """``step()`` is the worker's optimizer step; ``retire()`` withdraws its announcement for
        good; ``timeout_s`` bounds each DHT write of departing."""
        self.rules = list(rules)
        self._interval_s = interval_s
        self._key, self._stage, self._step, self._retire = key, stage, step, retire
        self._entry = OwnedEntry(dht, key, stage_departures_key(run_name, stage))
        self._ttl_s, self._timeout_s = departure_ttl_s, timeout_s
        self.verdict: Verdict | None = None
        self.fired = asyncio.Event()
        self._m_value = metrics.gauge(
            "agora_worker_termination_value",
            "What each self-termination rule measures now, in its unit (it trips at its threshold).",
            ["rule"],
        )
        self._m_terminated = metrics.counter(
            "agora_worker_terminations_total", "Self-terminations, by reason.", ["reason"]
        )
        # Enum-style, like agora_worker_phase: every reason at 0 from the start, the tripped
        # one at 1 in the last push a self-terminated worker makes (its gateway group stays).
        self._m_reason = metrics.gauge(
            "agora_worker_terminated",
            "1 for the reason this worker terminated itself, if it did.",
            ["reason"],
        )
        for reason in DepartureReason:
            self._m_reason.labels(reason=reason.value).set(0.0)

    @property
    def exit_code(self) -> int:
        """The process's exit code: 0 unless a rule tripped."""
        return 0 if self.verdict is None else self.verdict.exit_code

    def check(self, now: float | None = None) -> Verdict | None:
        """Evaluate every rule at ``now`` (world.monotonic()); the first verdict, if any tripped."""
        now = world.monotonic() if now is None else now
        tripped = None
        for rule in self.rules:
            verdict = rule.check(now)
            self._m_value.labels(rule=rule.reason).set(rule.value)
            tripped = tripped or verdict
        return tripped

    async def run(self) -> None:
        """Check every ``interval_s`` until a rule trips, then depart (a task of the worker)."""
        # A worker back with the same key is not departed any more: a monitor must not read
        # its previous life's record as news.
        await self._bounded("clear a previous departure", self._entry.withdraw())
        while True:
            try:
                verdict = self.check()
            except Exception:
                log.exception("termination_watchdog_failed")  # loud: the worker runs unguarded now
                raise
            if verdict is not None:
                await self.depart(verdict)
                return
            await asyncio.sleep(self._interval_s)

    async def wait(self) -> Verdict:
        """Until a rule tripped and the worker departed; the verdict."""
        await self.fired.wait()
        assert self.verdict is not None  # set before fired, by depart()
        return self.verdict

    async def depart(self, verdict: Verdict) -> None:
        """Stop serving and say why, both within the deadline; then set ``fired``."""
        self.verdict = verdict
        step = self._step()
        self._m_terminated.labels(reason=verdict.reason).inc()
        self._m_reason.labels(reason=verdict.reason).set(1.0)
        log.warning(
            "worker_terminated",
            reason=verdict.reason,
            value=verdict.value,
            threshold=verdict.threshold,
            unit=verdict.unit,
            exit_code=verdict.exit_code,
            stage=self._stage,
            step=step,
            detail=verdict.detail,
        )
        departure = WorkerDeparture(
            node_id=self._key.node_id,
            stage=self._stage,
            reason=verdict.reason,
            value=verdict.value,
            threshold=verdict.threshold,
            unit=verdict.unit,
            step=step,
            time=world.wall(),
            exit_code=verdict.exit_code,
            detail=verdict.detail,
        )
        await asyncio.gather(
            self._bounded("withdraw", self._retire()),
            self._bounded("publish the departure", self._entry.publish(departure.to_value(), self._ttl_s)),
        )
        self.fired.set()

    async def _bounded(self, what: str, work: Awaitable[object]) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                await work
        except (DhtError, RpcError, TimeoutError) as exc:  # leaving goes on: the DHT may be gone
            log.warning("departure_incomplete", failed_to=what, error=str(exc) or type(exc).__name__)


def rules_for(config: TerminationConfig, worker: Worker) -> list[Rule]:
    """The rules ``config`` switches on, over the signals ``worker`` keeps."""
    rules: list[Rule] = []
    if config.compute_failures:
        rules.append(
            InARow(
                DepartureReason.DEVICE_FAILURE,
                lambda: worker.runtime.failures_in_a_row,
                config.compute_failures,
                unit="requests",
                what="compute requests failed",
            )
        )
    if config.nonfinite_steps:
        rules.append(
            InARow(
                DepartureReason.NONFINITE_GRADIENTS,
                lambda: worker.optimizer.nonfinite_in_a_row,
                config.nonfinite_steps,
                unit="steps",
                what="optimizer steps with a NaN or infinite gradient",
            )
        )
    if config.unreachable_s:
        rules.append(
            Unreachable(
                peers=lambda: len(worker.dht.members()) - 1,  # members() includes the worker
                last_ok=lambda: max(worker.announcer.last_ok, worker.progress.last_ok),
                threshold_s=config.unreachable_s,
            )
        )
    if config.no_progress_s:
        rules.append(
            NoProgress(
                step=lambda: worker.progress.stage_step,
                pending=lambda: worker.progress.pending_samples,
                threshold_s=config.no_progress_s,
            )
        )
    if config.max_host_rss_mib:
        rules.append(HostMemory(limit_mib=config.max_host_rss_mib))
    if config.failed_rounds:
        rules.append(
            AveragingFailures(
                reports=lambda: worker.averager.reports,
                failed=config.failed_rounds,
                window=config.rounds_window,
            )
        )
    return rules


def watchdog_for(worker: Worker) -> Watchdog:
    """The watchdog of a worker: its run config's ``[termination]`` rules over its signals,
    and in an authorized run the credential's (lost: refused, expired or revoked)."""
    run = worker.run
    rules = rules_for(run.termination, worker)
    if worker.admission.authorized:
        rules.append(CredentialLost(lost=lambda: worker.admission.lost))
    return Watchdog(
        rules=rules,
        interval_s=run.termination.check_interval_s,
        dht=worker.dht,
        key=worker.key,
        run_name=run.name,
        stage=worker.stage,
        step=lambda: worker.optimizer.step,
        retire=worker.announcer.retire,
        departure_ttl_s=run.termination.departure_ttl_s,
        timeout_s=2 * run.dht.op_timeout_s,
        metrics=worker.metrics,
    )
