"""One microbatch's trip through the pipeline: forward head to tail, then backward, pinned.

A lane's microbatch is one sample or several, sent together: every hop is one request for all
of them, and the tail returns each sample's own loss.

Forward: at each stage the balancer picks a worker; the trainer sends it the tokens and the
previous stage's boundary and keeps what it sent. The tail runs ``forward_backward`` and
returns the loss and its input gradient. Backward walks the stages in reverse; each stage's
backward goes to **the worker that ran its forward** (its weights produced that activation),
falling back to another worker of the stage only if that one is gone. A failed call bans the
worker for a while and is retried on another, within a bounded number of attempts; a sample
that still cannot finish raises :class:`SampleFailed` and goes back to the queue.

The trainer witnesses its workers (``agora_trainer.witness``): once the tail's losses are
back, they are recorded against the worker of every stage, and a worker whose samples fare
far worse than its stage peers' gets no new microbatch for ``distrust_s``. Backwards of
samples it already forwarded still go to it: its weights made those activations, and a
gradient through another replica's weights would touch a sound replica to spare an unsound
one. A microbatch that went through a worker distrusted meanwhile is no evidence: its losses
are not recorded.

The trainer also spot-checks its workers (``agora_trainer.checking``): at each stage, some
forwards and backwards are asked again of a second replica, and a mismatch of a third. A
worker whose answer stands apart is distrusted the same way, and accused once it did so
repeatedly; when it was the hop's own worker, the microbatch goes on with the agreeing
replica's answer (a tail whose losses failed has no stand-in gradient: :class:`SampleFailed`).
Each completed microbatch is a receipt for the workers whose training it counts at (the
trainer's progress report carries them).
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.contract import Method
from agora_core.errors import BadRequest, RpcError, StageMismatch
from agora_core.injection import NO_INJECTIONS, InjectionPoints, Slowdown, Trigger
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, RpcClient
from agora_core.schema import MAX_RECEIPTS
from agora_trainer.balancer import StageBalancer, WorkerRef
from agora_trainer.checking import SpotChecks
from agora_trainer.spotcheck import SpotCheckConfig
from agora_trainer.witness import DISTRUST_S, LossWitness, WitnessConfig

log = get_logger("trainer.routing")


class SampleFailed(Exception):
    """A sample could not get through the pipeline now (no usable worker, retries spent)."""


@dataclass
class Counters:
    dispatched: int = 0  # samples taken from the shards (once each)
    completed: int = 0
    in_flight: int = 0
    requeued: int = 0  # samples handed back after SampleFailed, waiting to run again
    retries: int = 0  # calls retried on another worker
    failed_calls: int = 0
    fallbacks: int = 0  # backwards that could not go to their forward's worker
    outliers: int = 0  # workers judged loss outliers (each then distrusted for a while)


@dataclass
class LaneState:
    """What a lane is doing right now (for status lines and tests)."""

    stage: int = -1
    method: str = ""
    worker: str = ""
    started: float = field(default_factory=lambda: world.monotonic())  # read late: the world may be simulated


@dataclass
class RoutingConfig:
    request_timeout_s: float = 30.0
    max_attempts: int = 5  # per hop, across workers
    wait_for_worker_s: float = 30.0  # how long a hop waits for its stage to have a usable worker
    # Send each backward to the worker that ran the sample's forward (the paper's finding: a
    # backward through another replica's weights hurts). False: any worker, by the balancer --
    # for the ablation benchmark only.
    pin_backward: bool = True
    witness: WitnessConfig = field(default_factory=WitnessConfig)  # when a worker is a loss outlier
    distrust_s: float = DISTRUST_S  # how long an outlier gets no new microbatch
    spot_check: SpotCheckConfig = field(default_factory=SpotCheckConfig)


def weight_version(meta: object) -> int | None:
    """The weight version a forward's reply named (a worker's word: an int or nothing)."""
    version = meta.get("version") if isinstance(meta, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) and version >= 0 else None


class PipelineRouter:
    def __init__(
        self,
        client: RpcClient,
        balancers: list[StageBalancer],
        config: RoutingConfig,
        counters: Counters,
        metrics: NodeMetrics,
        injections: InjectionPoints = NO_INJECTIONS,
        node_id: str = "",
    ):
        """``injections``: where the operator's forward and backward triggers fire (before a
        hop's call goes out); ``node_id``: the trainer's, for its accusations."""
        self._client = client
        self._injections = injections
        self.slowdown = Slowdown()  # injected: every hop takes factor x as long
        # Injected: the next gradient this trainer sends is NaN (the worker's input check
        # refuses it with BadRequest, and the sample is abandoned, counted and logged).
        self.corrupt_next_gradient = False
        self._balancers = balancers
        self._config = config
        self.counters = counters
        self._m_hop = metrics.histogram(
            "agora_trainer_hop_seconds",
            "Round trip of one stage call.",
            ["to_stage", "method"],
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
        )
        self._m_retries = metrics.counter(
            "agora_trainer_retries_total", "Calls retried on another worker.", ["to_stage"]
        )
        self.witness = LossWitness(len(balancers), config.witness)
        self._m_outliers = metrics.counter(
            "agora_trainer_loss_outliers_total",
            "Workers whose samples' loss was far above their stage peers' (then distrusted).",
            ["to_stage"],  # "stage" is every node's own label: this is the worker's
        )
        for stage in range(len(balancers)):  # exported at 0 from the start
            self._m_outliers.labels(to_stage=str(stage))
        self.checks = SpotChecks(
            client,
            balancers,
            config.spot_check,
            metrics,
            node_id=node_id,
            request_timeout_s=config.request_timeout_s,
            distrust_s=config.distrust_s,
        )
        self.spot = self.checks.rules
        # Receipts: per worker, the samples of completed microbatches it computed (the
        # trainer's signed progress report carries them); the most recently credited last.
        self.receipts: collections.OrderedDict[str, int] = collections.OrderedDict()

    @property
    def stages(self) -> int:
        return len(self._balancers)

    async def _call(
        self,
        lane: LaneState,
        stage: int,
        method: str,
        tensors: dict,
        pinned: WorkerRef | None = None,
        *,
        version: int | None = None,
    ) -> tuple[WorkerRef, Payload]:
        """``version``: the weight version the pinned worker's forward named (sent to whichever
        worker serves the call: another's names mean nothing to it, and it says so by using
        its current weights)."""
        balancer = self._balancers[stage]
        samples = tensors["tokens"].shape[0]
        tried: set[str] = set()
        waited_until = world.monotonic() + self._config.wait_for_worker_s
        attempts = 0
        while attempts < self._config.max_attempts:
            worker = None
            if (
                pinned is not None
                and not balancer.banned(pinned.node_id)
                and not balancer.gone(pinned.node_id)
            ):
                worker, pinned = pinned, None  # first choice for a backward; failover after
            else:
                pinned = None
                worker = balancer.choose(samples, exclude=frozenset(tried))
                if worker is None and tried:
                    worker = balancer.choose(samples)  # every worker failed once: try them again
                if worker is None:
                    if world.monotonic() > waited_until:
                        raise SampleFailed(
                            f"stage {stage} has had no usable worker for {self._config.wait_for_worker_s:g} s"
                        )
                    await asyncio.sleep(0.05)  # the discovery loop refreshes the workers
                    continue
            attempts += 1
            lane.stage, lane.method, lane.worker, lane.started = (
                stage,
                method,
                worker.node_id,
                world.monotonic(),
            )
            token = balancer.begin(worker)
            started = world.monotonic()
            try:
                reply = await self._client.call(
                    worker.address,
                    method,
                    {"stage": stage} if version is None else {"stage": stage, "version": version},
                    tensors,
                    timeout_s=self._config.request_timeout_s,
                )
            except RpcError as exc:  # unreachable, deadline, overloaded, failed, wrong stage
                if isinstance(exc, BadRequest) and not isinstance(exc, StageMismatch):
                    raise  # our request is wrong: retrying elsewhere will not help
                balancer.fail(token)
                tried.add(worker.node_id)
                self.counters.failed_calls += 1
                self.counters.retries += 1
                self._m_retries.labels(to_stage=str(stage)).inc()
                continue
            finally:
                lane.method = ""
            elapsed = world.monotonic() - started
            if self.slowdown.factor != 1.0:
                await asyncio.sleep(self.slowdown.extra_s(elapsed))
            balancer.complete(token, samples, elapsed)
            self._m_hop.labels(to_stage=str(stage), method=method).observe(elapsed)
            return worker, reply
        raise SampleFailed(f"stage {stage} {method}: {attempts} attempts failed")

    def _witness(self, served: list[WorkerRef], losses: np.ndarray) -> None:
        """Record a microbatch's losses (B,) against its worker at each stage; distrust,
        count and log each worker they show to be a loss outlier."""
        if any(self._balancers[ref.stage].distrusted(ref.node_id) for ref in served):
            return  # taken before that worker's exclusion: no evidence about anyone
        for outlier in self.witness.record([ref.node_id for ref in served], losses):
            self._balancers[outlier.stage].distrust(outlier.node_id, self._config.distrust_s)
            self.counters.outliers += 1
            self._m_outliers.labels(to_stage=str(outlier.stage)).inc()
            log.warning(
                "worker_loss_outlier",
                stage=outlier.stage,
                node=outlier.node_id,
                mean_loss=round(outlier.mean_loss, 4),
                others_mean_loss=round(outlier.others_mean_loss, 4),
                samples=outlier.samples,
                others_samples=outlier.others_samples,
                distrust_s=self._config.distrust_s,
            )

    async def run(self, tokens: np.ndarray, lane: LaneState) -> np.ndarray:
        """Train on a microbatch (B, ``seq_len + 1``) of token ids; returns its losses (B,)."""
        inputs = tokens[:, :-1].astype(np.int32)  # (B, T)
        labels = tokens[:, 1:].astype(np.int32)  # (B, T)
        checks = self.checks
        # per stage: the worker, the input it got, the weight version its forward named
        hops: list[tuple[WorkerRef, np.ndarray | None, int | None]] = []
        boundary = None
        for stage in range(self.stages - 1):
            tensors = {"tokens": inputs} if boundary is None else {"tokens": inputs, "boundary": boundary}
            if self._injections.armed:
                self._injections.reached(Trigger.FORWARD)
            worker, reply = await self._call(lane, stage, Method.FORWARD, tensors)
            answer = {"boundary": reply.tensors["boundary"]}
            version = weight_version(reply.meta)
            if checks.due("forward"):
                agreed = await checks.check("forward", stage, Method.FORWARD, tensors, worker, answer)
                if agreed is not None:  # its worker stood apart: go on with the agreeing replica's
                    (worker, answer), version = agreed, None
            hops.append((worker, boundary, version))
            boundary = answer["boundary"]
        tail = self.stages - 1
        tail_inputs = {"tokens": inputs, "boundary": boundary, "labels": labels}
        tail_worker, reply = await self._call(lane, tail, Method.FORWARD_BACKWARD, tail_inputs)
        answer = {"loss": reply.tensors["loss"], "grad": reply.tensors["grad"]}
        trained = [tail_worker.node_id]  # the workers whose training the microbatch counts at
        if checks.due("gradient"):
            agreed = await checks.check("gradient", tail, Method.GRADIENT, tail_inputs, tail_worker, answer)
            if agreed is not None:  # the tail stood apart: it earns no receipt
                tail_worker, answer = agreed
                trained = []
        elif checks.due("forward"):  # its losses only: a wrong one's gradient has no stand-in
            losses_only = {"loss": answer["loss"]}
            if await checks.check("forward", tail, Method.FORWARD, tail_inputs, tail_worker, losses_only):
                raise SampleFailed(
                    f"the tail's losses failed a spot check ({tail_worker.node_id[:12]} stood apart)"
                )
        losses = np.asarray(answer["loss"], dtype=np.float64)
        if losses.shape != (tokens.shape[0],):
            raise SampleFailed(
                f"the tail returned losses of shape {losses.shape} for {tokens.shape[0]} samples"
            )
        self._witness([worker for worker, _, _ in hops] + [tail_worker], losses)
        grad = answer["grad"]
        for stage in range(self.stages - 2, -1, -1):
            forward_worker, sent, version = hops[stage]
            if self._injections.armed:
                self._injections.reached(Trigger.BACKWARD)
            if self.corrupt_next_gradient:
                self.corrupt_next_gradient = False
                grad = np.full(grad.shape, np.nan, dtype=np.float32)  # bf16 travels as tagged words
            tensors = {"tokens": inputs, "grad": grad}
            if sent is not None:
                tensors["boundary"] = sent
            pinned = forward_worker if self._config.pin_backward else None
            worker, reply = await self._call(
                lane, stage, Method.BACKWARD, tensors, pinned=pinned, version=version
            )
            if worker.node_id != forward_worker.node_id:
                self.counters.fallbacks += 1
            grad = reply.tensors.get("grad")
            trained.append(worker.node_id)
            if grad is not None and sent is not None and checks.due("gradient"):
                answer = {"grad": grad}
                agreed = await checks.check("gradient", stage, Method.GRADIENT, tensors, worker, answer)
                if agreed is not None:
                    grad = agreed[1]["grad"]
                    trained.pop()
        lane.stage = -1
        self._receipt(trained, tokens.shape[0])
        return losses

    def _receipt(self, workers: list[str], samples: int) -> None:
        """Credit ``workers`` with a completed microbatch's ``samples`` (at most
        ``MAX_RECEIPTS`` workers kept: the least recently credited go first)."""
        for node_id in workers:
            self.receipts[node_id] = self.receipts.pop(node_id, 0) + samples
        while len(self.receipts) > MAX_RECEIPTS:
            self.receipts.popitem(last=False)
