"""The stage's optimizer: fp32 master weights and AdamW state in host memory.

The compute copy of the weights lives on the device. On a CPU-only worker the two are the same
tensors; with an accelerator, gradients are added into the host copy after each microbatch
and the updated host weights are copied back after each step. Gradients accumulate over all
microbatches of a step; at the step they are averaged over the samples, clipped to the
stage's threshold (stage-wise clipping: 1/sqrt(S), twice that for the tail) and applied.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from agora_core.config.run import OptimizerConfig


@dataclass(frozen=True)
class StepReport:
    step: int  # the step just taken (the first is 1)
    samples: int  # samples its gradient averaged over
    grad_norm: float  # before clipping
    lr: float
    applied: bool  # False: no samples, or a non-finite gradient that was dropped


def learning_rate(step: int, config: OptimizerConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    floor = config.lr * config.min_lr_ratio
    return floor + 0.5 * (config.lr - floor) * (1 + math.cos(math.pi * progress))


class HostOptimizer:
    def __init__(
        self,
        module: nn.Module,
        config: OptimizerConfig,
        *,
        clip_threshold: float,
        separate_master: bool = False,
    ):
        """``separate_master`` keeps a host copy even when the module is on the CPU (it is
        forced for modules on an accelerator)."""
        self.config = config
        self.clip_threshold = clip_threshold
        self.lock = threading.RLock()  # held while weights change (steps, averaging)
        self.compute = [p for p in module.parameters() if p.requires_grad]
        on_device = any(p.device.type != "cpu" for p in self.compute)
        self.separate = separate_master or on_device
        if self.separate:
            self.master = [nn.Parameter(p.detach().to("cpu", torch.float32, copy=True)) for p in self.compute]
        else:
            self.master = self.compute
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

    def accumulate(self, samples: int) -> None:
        """Count a microbatch whose backward just added into the compute gradients."""
        with self.lock:
            if self.separate:
                for master, compute in zip(self.master, self.compute, strict=True):
                    if compute.grad is None:
                        continue
                    grad = compute.grad.detach().to("cpu", torch.float32)
                    master.grad = grad if master.grad is None else master.grad.add_(grad)
                    compute.grad = None
            self.samples += samples
            self.total_samples += samples

    def sync_compute(self) -> None:
        """Copy the host weights to the compute copy (after averaging changed them)."""
        if self.separate:
            with self.lock, torch.no_grad():
                for master, compute in zip(self.master, self.compute, strict=True):
                    compute.copy_(master)

    def apply(self) -> StepReport:
        """Take the step: average, clip, AdamW, zero. Runs on the compute thread."""
        with self.lock:
            samples, self.samples = self.samples, 0
            lr = learning_rate(self.step, self.config)
            grads = [m for m in self.master if m.grad is not None]
            norm = 0.0
            applied = False
            if samples and grads:
                for m in grads:
                    m.grad.div_(samples)
                norm = float(torch.nn.utils.clip_grad_norm_(grads, self.clip_threshold))
                if math.isfinite(norm):
                    for group in self.adamw.param_groups:
                        group["lr"] = lr
                    self.adamw.step()
                    applied = True
            self.adamw.zero_grad(set_to_none=True)
            for p in self.compute:
                p.grad = None
            if self.separate and applied:
                with torch.no_grad():
                    for master, compute in zip(self.master, self.compute, strict=True):
                        compute.copy_(master)
            self.step += 1
            # after the step count: a watchdog that reads this (on another thread) sees the step too
            if samples and grads:
                self.nonfinite_in_a_row = 0 if applied else self.nonfinite_in_a_row + 1
            return StepReport(self.step, samples, norm, lr, applied)
