"""The stage's optimizer: fp32 master weights and AdamW state in host memory.

The compute copy of the weights lives on the device. On a CPU-only worker the two are the same
tensors. Otherwise (a device, bf16 compute weights, or ``separate_master``) the masters are
host copies and ``transfers.TransferEngine`` moves between them: gradients accumulate on the
device over all microbatches of a step, cross to the host once at the step, AdamW runs there,
and the updated weights cross back once. At the step the gradients are averaged over the
samples, clipped to the stage's threshold (stage-wise clipping: 1/sqrt(S), twice that for the
tail) and applied.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from agora_core import world
from agora_core.config.run import OptimizerConfig
from agora_worker.transfers import BUCKET_BYTES, TransferEngine


@dataclass(frozen=True)
class StepReport:
    step: int  # the step just taken (the first is 1)
    samples: int  # samples its gradient averaged over
    grad_norm: float  # before clipping
    lr: float
    applied: bool  # False: no samples, or a non-finite gradient that was dropped
    seconds: float = 0.0  # on the compute thread: gradients to the host, AdamW, uploads queued


def learning_rate(step: int, config: OptimizerConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


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

    def apply(self) -> StepReport:
        """Take the step: average, clip, AdamW, zero. Runs on the compute thread."""
        with self.lock:
            started = world.monotonic()
            samples, self.samples = self.samples, 0
            lr = learning_rate(self.step, self.config)
            self._widen()
            grads = [w if w is not None else p.grad for w, p in zip(self._wide, self.compute, strict=True)]
            present = [g for g in grads if g is not None]
            norm = 0.0
            applied = False
            if samples and present:
                norm = float(total_norm(present)) / samples  # of the averaged gradient
                if math.isfinite(norm):
                    for group in self.adamw.param_groups:
                        group["lr"] = lr
                    self._update(grads, min(1.0, self.clip_threshold / (norm + 1e-6)) / samples)
                    applied = True
            self.adamw.zero_grad(set_to_none=True)
            for p in self.compute:
                p.grad = None
            self._wide = [None] * len(self.compute)
            self.step += 1
            # after the step count: a watchdog that reads this (on another thread) sees the step too
            if samples and present:
                self.nonfinite_in_a_row = 0 if applied else self.nonfinite_in_a_row + 1
            seconds = world.monotonic() - started
            self.step_seconds += seconds
            return StepReport(self.step, samples, norm, lr, applied, seconds)

    def _update(self, grads: list[torch.Tensor | None], scale: float) -> None:
        """AdamW on the masters with each gradient times ``scale``; the compute copy follows."""
        engine = self.transfers
        if engine is None:  # one copy: the gradients are the masters' own
            for g in grads:
                if g is not None:
                    g.mul_(scale)
            self.adamw.step()
            return
        engine.settle()  # the last upload may still be reading the masters AdamW changes
        with engine.upload() as send:
            for bucket in engine.gradients_to_host(grads):  # each as soon as it landed
                for i in bucket:
                    self.master[i].grad = engine.grads[i].mul_(scale)
                self.adamw.step()  # steps the weights that hold a gradient: this bucket's
                for i in bucket:
                    self.master[i].grad = None
                send(bucket)
