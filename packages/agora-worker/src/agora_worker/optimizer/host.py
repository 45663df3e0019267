"""The stage's optimizer: fp32 master weights and AdamW state in host memory.

The compute copy of the weights lives on the device. On a CPU-only worker the two are the same
tensors. Otherwise (a device, bf16 compute weights, or ``separate_master``) the masters are
host copies and ``transfers.TransferEngine`` moves between them: gradients accumulate on the
device over all microbatches of a step, cross to the host once at the step, AdamW runs there,
and the updated weights cross back once. At the step the gradients are averaged over the
samples, clipped to the stage's threshold (stage-wise clipping: 1/sqrt(S), twice that for the
tail) and applied.

A step in warm-up (a joiner's optimizer sync) feeds the gradient to AdamW's moments and leaves
the weights alone: the phase exists to bring moments that came from elsewhere, or sat idle
through weight sync, in line with the live gradients before they decide an update.

Every step is judged before AdamW takes it: the update it would make, per weight and in units
of the learning rate (the RMS of m^/(sqrt(v^) + eps), weight decay aside), against the median
of this optimizer's recent steps, or, with too few of those, against the most that a
consistent AdamW state can produce at all (|m^| / sqrt(v^) <= (1 - b1) / sqrt((1 - b2)(1 -
b1^2 / b2)) for any gradient history, 1.17 for the default betas). A step beyond
``max_update_ratio`` times that reference is refused: nothing changes, and the worker re-enters
weight sync. Moments whose first and second halves came from different replicas, or a second
moment lost, make such steps, and one such step can wreck a replica.
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agora_core import world
from agora_core.config.run import OptimizerConfig
from agora_worker.optimizer.transfers import BUCKET_BYTES, TransferEngine


@dataclass(frozen=True)
class StepReport:
    step: int  # the step just taken (the first is 1)
    samples: int  # samples its gradient averaged over
    grad_norm: float  # before clipping
    lr: float
    applied: bool  # False: no samples, a non-finite gradient that was dropped, or refused
    seconds: float = 0.0  # on the compute thread: gradients to the host, AdamW, uploads queued
    warmup: bool = False  # the gradient went into AdamW's moments, not into the weights
    update_ratio: float = 0.0  # the update per weight in learning rates (RMS of m^/sqrt(v^))
    refused: str = ""  # why the step was refused (its update far beyond the recent ones)


def learning_rate(step: int, config: OptimizerConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


# Recent update ratios the guard compares a step with, and how many it needs before it trusts
# their median over the a-priori bound.
RECENT_STEPS = 32
MIN_RECENT_STEPS = 4


def adam_ratio_bound(betas: Sequence[float]) -> float | None:
    """The largest |m^| / sqrt(v^) any gradient history gives AdamW (None: unbounded betas).
    By Cauchy-Schwarz over the EMA weights, m^2 <= v * (1 - b1)^2 / ((1 - b2)(1 - b1^2 / b2))."""
    b1, b2 = betas
    rho = b1 * b1 / b2 if b2 else math.inf
    if rho >= 1:
        return None
    return (1 - b1) / math.sqrt((1 - b2) * (1 - rho))


def adam_direction_square_sum(
    adamw: torch.optim.AdamW, params: Sequence[torch.Tensor], *, betas: Sequence[float], eps: float
) -> tuple[float, int]:
    """Sum of squares and count of m^/(sqrt(v^) + eps) over ``params`` holding a gradient: the
    update AdamW is about to make per unit of learning rate, weight decay aside. Reads the
    moments, changes nothing."""
    b1, b2 = betas
    total, count = 0.0, 0
    with torch.no_grad():
        for p in params:
            g = p.grad
            if g is None:
                continue
            state = adamw.state.get(p)
            t = (float(state["step"]) if state else 0.0) + 1
            if state:
                m = state["exp_avg"].mul(b1).add_(g, alpha=1 - b1)
                v = state["exp_avg_sq"].mul(b2).addcmul_(g, g, value=1 - b2)
            else:
                m, v = g.mul(1 - b1), g.mul(g).mul_(1 - b2)
            m.div_(1 - b1**t).div_(v.div_(1 - b2**t).sqrt_().add_(eps))
            total += float(torch.linalg.vector_norm(m, dtype=torch.float64)) ** 2
            count += m.numel()
    return total, count


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all ``grads`` together, where they live (a scalar tensor)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


class HostOptimizer:
    def __init__(
        self,
        module: nn.Module,
        config: OptimizerConfig,
        *,
        clip_threshold: float,
        separate_master: bool = False,
        compute_dtype: torch.dtype = torch.float32,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        """``separate_master`` keeps a host copy even when the module is on the CPU (it is
        forced for modules on an accelerator and for a ``compute_dtype`` other than fp32:
        the module's trained weights are then narrowed to it, masters staying fp32).
        ``bucket_bytes``: the granularity of the step's transfers (``transfers``)."""
        self.config = config
        self.clip_threshold = clip_threshold
        self.lock = threading.RLock()  # held while weights change (steps, averaging)
        self.compute = [p for p in module.parameters() if p.requires_grad]
        on_device = any(p.device.type != "cpu" for p in self.compute)
        self.separate = separate_master or on_device or compute_dtype != torch.float32
        self.transfers = TransferEngine(self.compute, bucket_bytes=bucket_bytes) if self.separate else None
        self.master = self.transfers.masters if self.transfers is not None else self.compute
        if compute_dtype != torch.float32:  # after the masters took the fp32 values
            with torch.no_grad():
                for p in self.compute:
                    p.data = p.data.to(compute_dtype)
        # fp32 accumulators of a narrower compute copy's gradients (None: fp32 ones stay in .grad)
        self._wide: list[torch.Tensor | None] = [None] * len(self.compute)
        decay = [m for m in self.master if m.ndim >= 2]  # matrices decay; norms and biases do not
        rest = [m for m in self.master if m.ndim < 2]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=learning_rate(0, config),
            betas=tuple(config.betas),
            eps=config.eps,
        )
        self.step = 0
        self.samples = 0  # accumulated toward the next step
        self.total_samples = 0  # ever accumulated (averaging weighs peers by its increase)
        self.nonfinite_in_a_row = 0  # steps in a row whose gradient was dropped as NaN/infinite
        self.step_seconds = 0.0  # every step's time on the compute thread, summed
        # update ratios of the recent steps the guard let through (warm-up ones included)
        self.recent_ratios: collections.deque[float] = collections.deque(maxlen=RECENT_STEPS)
        self.refused_steps = 0

    # --- microbatches ---------------------------------------------------------------------------

    def accumulate(self, samples: int) -> None:
        """Count a microbatch whose backward just added into the compute gradients. They stay
        where they are until the step (a narrower compute copy's are added into fp32 here)."""
        with self.lock:
            self._widen()
            self.samples += samples
            self.total_samples += samples

    @contextlib.contextmanager
    def accumulating(self, samples: int) -> Iterator[None]:
        """Wrap one microbatch's backward: its gradients join the step's and its samples count
        only if the block completes. An exception (memory ran out halfway through the backward)
        leaves both as they were, so the microbatch can be retried, split, without counting any
        of it twice."""
        held = [p.grad for p in self.compute]
        for p in self.compute:
            p.grad = None  # the backward writes this microbatch's gradients alone
        try:
            yield
        except BaseException:
            for p, grad in zip(self.compute, held, strict=True):
                p.grad = grad
            raise
        for p, grad in zip(self.compute, held, strict=True):
            if grad is not None:
                p.grad = grad if p.grad is None else grad.add_(p.grad)
        self.accumulate(samples)

    def discard_gradients(self) -> None:
        """Drop what the step accumulated, gradients and samples (a state install replaced the
        weights they belong to)."""
        with self.lock:
            for p in self.compute:
                p.grad = None
            self._wide = [None] * len(self.compute)
            self.samples = 0

    def _widen(self) -> None:
        for i, p in enumerate(self.compute):
            if p.grad is None or p.grad.dtype == torch.float32:
                continue
            wide = self._wide[i]
            self._wide[i] = p.grad.float() if wide is None else wide.add_(p.grad)
            p.grad = None

    # --- master weights -------------------------------------------------------------------------

    def sync_compute(self) -> None:
        """Copy the host weights to the compute copy, once (after averaging changed them)."""
        if self.transfers is not None:
            with self.lock:
                self.transfers.upload_all()

    @contextlib.contextmanager
    def writing_masters(self) -> Iterator[list[nn.Parameter]]:
        """Change the master weights outside a step (averaging's delta rule, a state install):
        under the lock, once the last upload has read them; the compute copy follows at the end,
        in one transfer. Gradients accumulated meanwhile stay as they are."""
        with self.lock, torch.no_grad():
            if self.transfers is not None:
                self.transfers.settle()
            try:
                yield self.master
            finally:
                self.sync_compute()

    # --- the step -------------------------------------------------------------------------------

    def apply(self, *, warmup: bool = False) -> StepReport:
        """Take the step: average, clip, judge, AdamW, zero. Runs on the compute thread.
        ``warmup``: AdamW's moments take the gradient, the weights stay as they are."""
        with self.lock:
            started = world.monotonic()
            samples, self.samples = self.samples, 0
            lr = learning_rate(self.step, self.config)
            self._widen()
            grads = [w if w is not None else p.grad for w, p in zip(self._wide, self.compute, strict=True)]
            present = [g for g in grads if g is not None]
            norm = ratio = 0.0
            applied = finite = False
            refused = ""
            if samples and present:
                norm = float(total_norm(present)) / samples  # of the averaged gradient
                finite = math.isfinite(norm)
                if finite:
                    for group in self.adamw.param_groups:
                        group["lr"] = 0.0 if warmup else lr  # lr 0: the moments move, the weights not
                    scale = min(1.0, self.clip_threshold / (norm + 1e-6)) / samples
                    ratio, refused = self._update(grads, scale, warmup=warmup)
                    applied = not refused or warmup
            self.adamw.zero_grad(set_to_none=True)
            for p in self.compute:
                p.grad = None
            self._wide = [None] * len(self.compute)
            self.step += 1
            # after the step count: a watchdog that reads this (on another thread) sees the step too
            if samples and present:
                self.nonfinite_in_a_row = 0 if finite else self.nonfinite_in_a_row + 1
            if not refused and applied:
                self.recent_ratios.append(ratio)
            elif applied:  # a warm-up step beyond the guard: the moments still had to take it
                refused = ""
            elif refused:
                self.refused_steps += 1
            seconds = world.monotonic() - started
            self.step_seconds += seconds
            return StepReport(
                self.step, samples, norm, lr, applied, seconds, warmup=warmup and applied,
                update_ratio=ratio, refused=refused,
            )  # fmt: skip

    def refusal(self, ratio: float) -> str:
        """Why a step whose update is ``ratio`` learning rates per weight must not be taken
        ("" if it may): beyond ``max_update_ratio`` x the median of the recent steps, or, with
        fewer than MIN_RECENT_STEPS of those, x the a-priori bound of AdamW's ratio."""
        factor = self.config.max_update_ratio
        if not factor:
            return ""
        recent = self.recent_ratios
        if len(recent) >= MIN_RECENT_STEPS:
            reference, what = statistics.median(recent), f"the median of its last {len(recent)} steps"
        else:
            bound = adam_ratio_bound(self.config.betas)
            if bound is None:
                return ""
            reference, what = bound, "what a consistent AdamW state can give"
        if not ratio <= factor * reference:  # a NaN ratio is refused too
            return f"update {ratio:.3g} lr per weight, {ratio / reference:.1f}x {what} ({reference:.3g})"
        return ""

    def _judged(self, params: Sequence[torch.Tensor]) -> tuple[float, int, str]:
        total, count = adam_direction_square_sum(
            self.adamw, params, betas=self.config.betas, eps=self.config.eps
        )
        ratio = math.sqrt(total / count) if count else 0.0
        return total, count, self.refusal(ratio)

    def _update(self, grads: list[torch.Tensor | None], scale: float, *, warmup: bool) -> tuple[float, str]:
        """AdamW on the masters with each gradient times ``scale``, unless the guard refuses
        it (a warm-up step is taken regardless: only the moments move, and taking live
        gradients is what brings them in line); the compute copy follows. Returns the update
        ratio and the guard's verdict ("" if none). On a device, buckets are judged and stepped
        as they land: a refused bucket and every later one are left as they are (the worker
        then re-syncs its weights anyway)."""
        engine = self.transfers
        if engine is None:  # one copy: the gradients are the masters' own
            for g in grads:
                if g is not None:
                    g.mul_(scale)
            total, count, refused = self._judged(self.master)
            if warmup or not refused:
                self.adamw.step()
            return (math.sqrt(total / count) if count else 0.0), refused
        engine.settle()  # the last upload may still be reading the masters AdamW changes
        total, count, refused = 0.0, 0, ""
        with engine.upload() as send:
            for bucket in engine.gradients_to_host(grads):  # each as soon as it landed
                for i in bucket:
                    self.master[i].grad = engine.grads[i].mul_(scale)
                if warmup or not refused:
                    part, n, verdict = self._judged([self.master[i] for i in bucket])
                    total, count, refused = total + part, count + n, refused or verdict
                    if warmup or not refused:
                        self.adamw.step()  # steps the weights that hold a gradient: this bucket's
                for i in bucket:
                    self.master[i].grad = None
                send(bucket)
        return (math.sqrt(total / count) if count else 0.0), refused
