"""A trainer: many lanes, each keeping one microbatch in flight through the swarm's pipeline.

The trainer holds no parameters. It joins the run's DHT, learns each stage's workers from
their announcements, and runs ``lanes`` concurrent sample loops over its shards until they
are exhausted (or ``max_samples`` are done). Progress goes to the DHT under its own signed
subkey; its position in the shards goes to a state file, so a restart resumes exactly. In an
authorized run it starts routing only once admitted (``admission``), and it drops any worker
on the run's revocation list, read with every refresh of the worker lists.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agora_core import world
from agora_core.admission.accusations import accusations_key
from agora_core.admission.revocations import parse_revocations, revocations_key
from agora_core.config import RunConfig
from agora_core.dht import DhtError
from agora_core.dht.owned import OwnedEntry, check_refresh
from agora_core.errors import BadRequest, RpcError
from agora_core.identity import NodeKey
from agora_core.injection import InjectionPoints, NodeEffects
from agora_core.injection.operators import OperatorKeys
from agora_core.node.role import RoleNode
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.schema import (
    TrainerProgress,
    WorkerAnnouncement,
    parse_entries,
    stage_workers_key,
    trainer_progress_key,
)
from agora_trainer.balancer import StageBalancer
from agora_trainer.data.cursor import Sample, SampleCursor
from agora_trainer.data.manifest import check_run_tokenizer
from agora_trainer.data.rotation import ShardRotation
from agora_trainer.data.rotation_record import longest_ttl_s
from agora_trainer.data.shards import open_shard_set
from agora_trainer.routing import Counters, LaneState, PipelineRouter, RoutingConfig, SampleFailed
from agora_trainer.settings import TrainerSettings
from agora_trainer.spotcheck import SpotCheckConfig
from agora_trainer.witness import WitnessConfig

log = get_logger("trainer")

LOSS_EMA = 0.95  # weight of the running value in the loss average
IDLE_POLL_S = 0.05  # a lane with nothing to take looks again this often


class Trainer:
    def __init__(
        self,
        *,
        run: RunConfig,
        shards_dir: str | Path,
        key: NodeKey,
        bootstrap: Sequence[str] = (),
        listen: str = "127.0.0.1:0",
        advertise: str | None = None,
        settings: TrainerSettings | None = None,
        metrics: NodeMetrics | None = None,
        link: LinkEmulator | None = None,
        member: RoleNode | None = None,
    ):
        """``member``: the node it runs on, already built (an authorized trainer's, its
        admission given), instead of a new open-run member on ``listen`` with ``metrics``."""
        self.run = run
        self.key = key
        self.settings = settings or TrainerSettings()
        check_refresh(self.settings.progress_interval_s, run.dht.record_ttl_s, "progress_interval_s")
        self.member = RoleNode.given_or_built(
            member,
            "trainer",
            run,
            key,
            metrics=metrics,
            listen=listen,
            bootstrap=bootstrap,
            advertise=advertise,
            link=link,
        )
        self.node, self.metrics, self.admission = self.member.node, self.member.metrics, self.member.admission
        # Training shards only (validation ones are never opened), each checked against its
        # digest, made with the run's tokenizer.
        shard_set = open_shard_set(shards_dir, "train")
        check_run_tokenizer(shard_set.tokenizer, run.data, run.model.vocab_size, where=str(shards_dir))
        shards = shard_set.shards
        state = (
            Path(self.settings.state_file)
            if self.settings.state_file
            else Path(shards_dir) / f".trainer-{key.node_id[:12]}.json"
        )
        self.cursor = SampleCursor(
            shards,
            run.model.seq_len,
            state,
            shuffle_seed=run.data.shuffle_seed,
            epochs=self.settings.epochs,
            assigned=self.settings.assigned_shards(),
        )
        self.client, self.dht = self.node.client, self.node.dht
        self.balancers = [
            StageBalancer(stage, ban_s=self.settings.ban_s, gone=self.dht.gone)
            for stage in range(run.model.n_stages)
        ]
        self.counters = Counters()
        routing = RoutingConfig(
            request_timeout_s=run.transport.request_timeout_s,
            max_attempts=self.settings.max_attempts,
            wait_for_worker_s=self.settings.wait_for_worker_s,
            pin_backward=self.settings.backward_routing == "pinned",
            witness=WitnessConfig(ratio=self.settings.loss_outlier_ratio),
            distrust_s=self.settings.distrust_s,
            spot_check=SpotCheckConfig(fraction=self.settings.spot_check_fraction),
        )
        self.injections = InjectionPoints()  # where the operator's injected failures fire
        self.router = PipelineRouter(
            self.client,
            self.balancers,
            routing,
            self.counters,
            self.metrics,
            injections=self.injections,
            node_id=key.node_id,
        )
        self.injection_watch = self.member.injection_watcher(
            stage=None,
            points=self.injections,
            effects=NodeEffects(slow=self.router.slowdown.set, corrupt_next_gradient=self._corrupt_next),
        )
        self.progress = OwnedEntry(self.dht, key, trainer_progress_key(run.name))
        self.accusations = OwnedEntry(self.dht, key, accusations_key(run.name))  # its spot checks'
        self.rotation = ShardRotation(
            dht=self.dht,
            key=key,
            run_name=run.name,
            shard_set=shard_set.identity,
            cursor=self.cursor,
            operators=OperatorKeys(
                run.operator, None if self.node.security is None else self.node.security.verifier
            ),
            interval_s=self.settings.progress_interval_s,
            adopt_after_s=self.settings.shard_adopt_after_s,
            claim_ttl_s=longest_ttl_s(run.dht.max_expiration_ahead_s, run.dht.max_clock_skew_s),
            metrics=self.metrics,
        )
        self.lanes = [LaneState() for _ in range(self.settings.lanes)]
        self.revoked: set[str] = set()  # worker node ids on the run's revocation list
        self.completed_ids: list[int] = []  # in completion order (tools and tests read it)
        self.loss_last: float | None = None
        self.loss_ema: float | None = None
        self.tokens = 0
        self.abandoned = 0
        self._failures: collections.Counter[int] = collections.Counter()
        self._taken = 0
        self._stopping = False
        self._tasks: list[asyncio.Task] = []
        self.started_at = world.monotonic()
        # Appended per sample and flushed, so tools can follow it and a crash loses nothing.
        self._loss_log = open(self.settings.loss_log, "a", buffering=1) if self.settings.loss_log else None
        m = self.metrics
        self._m_loss = m.gauge("agora_trainer_loss", "Loss, exponential moving average.")
        self._m_samples = m.counter("agora_trainer_samples_total", "Samples, by outcome.", ["outcome"])
        for outcome in ("completed", "abandoned", "requeued"):  # exported at 0 from the start
            self._m_samples.labels(outcome=outcome)
        self._m_tokens = m.counter("agora_trainer_tokens_total", "Tokens trained on.")
        self._m_busy = m.gauge("agora_trainer_lanes_busy", "Lanes with a sample in flight.")
        self._m_bans = m.gauge("agora_trainer_bans", "Workers banned after a failed call, so far.")

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Join the DHT, wait until admitted (at once in an open run) and until every stage has
        at least one worker."""
        await self.node.start()
        await self.injection_watch.start()
        await self.admission.admitted()
        try:
            await self.rotation.start()  # the operator's assignment and the other trainers' claims
        except (DhtError, RpcError) as exc:  # retried every progress interval; no shard opens until read
            log.warning("shard_rotation_failed", error=str(exc))
            await self.rotation.start_background()
        await self.refresh()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._refresh_loop(), name="trainer-refresh"),
            loop.create_task(self._progress_loop(), name="trainer-progress"),
            loop.create_task(self.admission.run(), name="trainer-credential"),  # revocations: refresh()
        ]
        deadline = world.monotonic() + self.settings.wait_for_worker_s
        while not all(b.workers for b in self.balancers):
            missing = [b.stage for b in self.balancers if not b.workers]
            if world.monotonic() > deadline:
                raise DhtError(f"stages {missing} have no worker after {self.settings.wait_for_worker_s:g} s")
            log.info("waiting_for_workers", stages=missing)
            await asyncio.sleep(min(1.0, self.settings.refresh_interval_s))
            await self.refresh()

    async def close(self, *, release: bool = True) -> None:
        """Leave the run. ``release``: hand the shards it holds to the other trainers at once
        (its last claim says where it stopped); without, they wait for this trainer until its
        claim is ``shard_adopt_after_s`` old, as after a crash."""
        await self.injection_watch.stop()
        self.cursor.close()
        # a claim is a member's: none without a credential
        await self.rotation.stop(publish=release and self.admission.valid)
        if self._loss_log is not None:
            self._loss_log.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.admission.close()
        if self.admission.valid:  # progress is a member's report: none without a credential
            with _quiet():
                await self.publish_progress()
        await self.node.stop(grace_s=1.0)

    def _corrupt_next(self) -> None:
        self.router.corrupt_next_gradient = True

    def request_stop(self) -> None:
        """Lanes finish the sample they hold, then stop; ``train`` returns."""
        self._stopping = True

    # --- discovery and progress -------------------------------------------------------------------

    async def refresh(self) -> None:
        """Re-read every stage's worker announcements and, in an authorized run, the revocation
        list: revoked workers leave routing now, and a revoked trainer loses its credential."""
        keys = [stage_workers_key(self.run.name, s) for s in range(len(self.balancers))]
        listed = [revocations_key(self.run.name)] if self.admission.authorized else []
        found = await self.dht.get_many(keys + listed)
        if listed:
            revocations = parse_revocations(found[listed[0]], self.run.admission.authorizer_key_bytes)
            self.admission.observe(revocations)
            self.revoked = set() if revocations is None else set(revocations.nodes)
        for balancer, key in zip(self.balancers, keys, strict=True):
            announced = parse_entries(found[key], WorkerAnnouncement.from_value)
            balancer.update([a for a in announced if a.node_id not in self.revoked])

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_interval_s)
            with _quiet():
                await self.refresh()

    def report(self) -> TrainerProgress:
        return TrainerProgress(
            node_id=self.key.node_id,
            loss_ema=self.loss_ema,
            loss_last=self.loss_last,
            samples=self.counters.completed,
            tokens=self.tokens,
            lanes=len(self.lanes),
            receipts=dict(self.router.receipts),
        )

    async def publish_progress(self) -> None:
        """Progress, and the accusations its spot checks stand by (every period: they expire)."""
        await self.progress.publish(self.report().to_value(), self.run.dht.record_ttl_s)
        accusations = self.router.spot.record()
        if accusations is not None:
            await self.accusations.publish(accusations.to_value(), self.run.dht.record_ttl_s)

    async def _progress_loop(self) -> None:
        while True:
            with _quiet():
                await self.publish_progress()
            self._m_bans.set(sum(b.bans for b in self.balancers))
            self._m_busy.set(self.counters.in_flight)
            await asyncio.sleep(self.settings.progress_interval_s)

    # --- training -----------------------------------------------------------------------------

    async def train(self) -> Counters:
        """Run the lanes until the shards are done, ``max_samples`` completed, or a stop."""
        self.started_at = world.monotonic()
        await asyncio.gather(*(self._lane(state) for state in self.lanes))
        self.cursor.save()
        return self.counters

    def _limit_reached(self) -> bool:
        limit = self.settings.max_samples
        return limit is not None and self.counters.completed + self.counters.in_flight >= limit

    def _next_sample(self) -> Sample | None:
        if self._stopping or self._limit_reached():
            return None
        sample = self.cursor.take()
        if sample is None:
            return None
        if self._failures[sample.id]:
            self.counters.requeued -= 1
        else:
            self.counters.dispatched += 1
        return sample

    def _take(self) -> list[Sample]:
        """A lane's next microbatch: up to ``microbatch`` samples, fewer where the shards, the
        limit or a stage's workers take fewer now; each counts in flight once taken."""
        most = self.settings.microbatch
        for balancer in self.balancers if most > 1 else ():  # any worker takes one sample
            largest = balancer.largest_batch()
            most = most if largest is None else min(most, largest)
        taken: list[Sample] = []
        while len(taken) < most:
            sample = self._next_sample()
            if sample is None:
                break
            taken.append(sample)
            self.counters.in_flight += 1
        return taken

    async def _lane(self, state: LaneState) -> None:
        while True:
            samples = self._take()
            if not samples:
                if self._stopping or self._limit_reached() or self.cursor.finished:
                    return
                # Nothing to take now: samples in flight on other lanes may come back, or a
                # shard is on its way (handed over, or the claims of a new epoch not read yet).
                await asyncio.sleep(IDLE_POLL_S)
                continue
            try:
                losses = await self.router.run(np.stack([sample.tokens for sample in samples]), state)
            except (SampleFailed, BadRequest) as exc:
                for sample in samples:  # a microbatch fails whole: each sample is requeued or abandoned
                    self._sample_failed(sample, exc)
                continue
            finally:
                self.counters.in_flight -= len(samples)
                state.stage = -1
            for sample, loss in zip(samples, losses, strict=True):
                self._sample_done(sample, float(loss))

    def _sample_done(self, sample: Sample, loss: float) -> None:
        # Saved with every completion: a trainer that crashes (an injected exit, a kill) and
        # restarts on its state file repeats none of its completed samples (every 64th, it
        # repeated up to 63). One small atomic file write per sample (a few tens of us).
        self.cursor.complete(sample.id)
        self.completed_ids.append(sample.id)
        self.counters.completed += 1
        tokens = len(sample.tokens) - 1
        self.tokens += tokens
        self.loss_last = loss
        self.loss_ema = loss if self.loss_ema is None else LOSS_EMA * self.loss_ema + (1 - LOSS_EMA) * loss
        self._m_loss.set(self.loss_ema)
        if self._loss_log is not None:
            self._loss_log.write(json.dumps({"id": sample.id, "loss": loss, "t": world.wall()}) + "\n")
        self._m_samples.labels(outcome="completed").inc()
        self._m_tokens.inc(tokens)

    def _sample_failed(self, sample: Sample, error: Exception) -> None:
        self._failures[sample.id] += 1
        if isinstance(error, BadRequest) or self._failures[sample.id] > self.settings.max_requeues:
            # Never silent: counted, logged, and marked done so the shard position moves on.
            self.abandoned += 1
            self.cursor.complete(sample.id)
            self._m_samples.labels(outcome="abandoned").inc()
            log.error(
                "sample_abandoned", sample=sample.id, attempts=self._failures[sample.id], error=str(error)
            )
            return
        self.cursor.give_back(sample)
        self.counters.requeued += 1
        self._m_samples.labels(outcome="requeued").inc()
        log.warning("sample_requeued", sample=sample.id, error=str(error))

    def status(self) -> dict:
        elapsed = max(world.monotonic() - self.started_at, 1e-9)
        return {
            "completed": self.counters.completed,
            "in_flight": self.counters.in_flight,
            "samples_per_s": self.counters.completed / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "loss": self.loss_last,
            "loss_ema": self.loss_ema,
            "retries": self.counters.retries,
            "bans": sum(b.bans for b in self.balancers),
            "outliers": self.counters.outliers,
            "spot_checks": self.router.checks.made,
            "spot_mismatches": self.router.checks.mismatches,
            "spot_unresolved": self.router.checks.unresolved,
            "accused": sorted(self.router.spot.accused),
            "workers": [len(b.workers) for b in self.balancers],
            "abandoned": self.abandoned,
        }


class _quiet:
    """Swallow the DHT/RPC errors of background bookkeeping (logged, never fatal)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, error, _traceback) -> bool:
        if error is not None and isinstance(error, (DhtError, RpcError)):
            log.warning("bookkeeping_failed", error=str(error))
            return True
        return False
