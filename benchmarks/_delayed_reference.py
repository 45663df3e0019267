"""The centralized reference trained with a pipeline's delay, and nothing else of a swarm.

``tools/reference_train.py`` steps every ``target_batch_size`` samples with each sample's
gradient taken at the weights of the step it lands in. A pipelined swarm with ``in_flight``
samples between its trainers' forwards and backwards cannot: when sample i's forward runs at
a stage, the samples before it that are still in flight have not yet reached that stage's step,
so its forward runs under the weights of step floor((i - in_flight) / B) while its gradient lands
in step floor(i / B). The tail runs its forward and backward in one request: no delay there.
Here every sample is trained one at a time under exactly those weights (forward and backward
under the same ones, as a worker that keeps its forwards' weights does), in the reference's
order, one process, no messages, no averaging: what remains of the gap between this and the
reference is the delay alone. With ``in_flight`` 0 it reproduces the reference's losses.
A late sample's non-tail gradients go by the run's ``optimizer.stale_gradients``, as a
worker's do: added to the step they land in ("apply"), or left out ("drop"; the sample still
counts toward the batch, and the tail, never late, keeps its gradient).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.func import functional_call

from agora_model.reference import ReferenceModel
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.shards import open_shard_set


def delayed_losses(run, shards_dir: str, samples: int, in_flight: int) -> list[float]:
    """Per-sample losses, in the trainer's sample order, of the reference with each non-tail
    stage's forward and backward ``in_flight`` samples behind its step."""
    torch.manual_seed(run.seed)
    cursor = SampleCursor(
        open_shard_set(shards_dir, "train").shards, run.model.seq_len, shuffle_seed=run.data.shuffle_seed
    )
    model = ReferenceModel(run)
    batch = run.optimizer.target_batch_size
    # each step's weights, kept while a forward may still be behind them
    kept = [_weights(model)]
    first_kept = 0  # the step kept[0] holds
    losses: list[float] = []
    for index in range(samples):
        sample = cursor.take().tokens
        tokens = torch.from_numpy(sample[None, :-1].astype(np.int64))
        labels = torch.from_numpy(sample[None, 1:].astype(np.int64))
        behind = max(0, index - in_flight) // batch  # the step the forward ran under
        weights = kept[behind - first_kept]
        boundary = None
        used = []
        for stage, module in enumerate(model.stages[:-1]):
            params = {
                name: weights[stage][name].clone().requires_grad_(p.requires_grad)
                for name, p in module.named_parameters()
            }
            used.append((module, params))
            boundary = functional_call(module, params, (tokens, boundary))
        loss = model.stages[-1](tokens, boundary, labels)  # the tail: its live weights
        loss.sum().backward()
        if behind < index // batch and run.optimizer.stale_gradients == "drop":
            used = []  # its forward ran before the step it lands in: stale
        for module, params in used:  # into the live weights' gradients, for the next step
            for name, param in module.named_parameters():
                grad = params[name].grad if param.requires_grad else None
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad + grad
        for optimizer in model.optimizers:
            optimizer.accumulate(1)
        losses.append(float(loss.detach()))
        if (index + 1) % batch == 0:
            model.step()
            kept.append(_weights(model))
            oldest = max(0, index + 1 - in_flight) // batch  # the oldest a later forward uses
            while first_kept < oldest:
                kept.pop(0)
                first_kept += 1
    return losses


def _weights(model: ReferenceModel) -> list[dict[str, torch.Tensor]]:
    return [{name: p.detach().clone() for name, p in module.named_parameters()} for module in model.stages]
