"""Running a whole model in one process: held-out loss, and text sampled from a prompt.

The stages run in order exactly as the swarm runs them, boundary codec included (head ->
bodies -> tail), so what is measured here is what the swarm trained. For a transformer run
this equals ``ComposedModel`` on the same weights, up to float rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from agora_worker.model.loss import per_sample_loss


class WholeModel:
    def __init__(self, stages: Sequence[nn.Module], *, seq_len: int):
        if not stages:
            raise ValueError("a model needs at least one stage")
        self.stages = list(stages)
        self.seq_len = seq_len  # the longest input the model was built for (positional signal)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) next-token logits."""
        if tokens.shape[1] > self.seq_len:
            raise ValueError(f"{tokens.shape[1]} tokens exceed the model's seq_len {self.seq_len}")
        boundary = None
        for stage in self.stages[:-1]:
            boundary = stage(tokens, boundary)  # (B, T, k)
        return self.stages[-1](tokens, boundary)

    @torch.no_grad()
    def losses(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, T) inputs and next-token labels -> (B,) mean cross-entropy per sample."""
        return per_sample_loss(self.logits(tokens), labels)


def held_out_loss(
    model: WholeModel,
    samples: np.ndarray,
    *,
    batch_size: int = 16,
    progress: Callable[[int, float], None] | None = None,
) -> float:
    """Mean per-token loss over ``samples`` (N, T + 1): inputs ``[:, :-1]``, labels ``[:, 1:]``.
    ``progress(done, mean so far)`` is called after every batch."""
    if samples.ndim != 2 or samples.shape[0] == 0 or samples.shape[1] < 2:
        raise ValueError(f"samples must be (N >= 1, T + 1 >= 2) token ids, got shape {samples.shape}")
    total, done = 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = torch.from_numpy(samples[start : start + batch_size].astype(np.int64))
        losses = model.losses(batch[:, :-1], batch[:, 1:])  # (B,), every sample T tokens long
        total += float(losses.double().sum())
        done += len(batch)
        if progress is not None:
            progress(done, total / done)
    return total / done


def generate(
    model: WholeModel,
    prompt: np.ndarray,
    *,
    new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    vocab_limit: int | None = None,
    stop_token: int | None = None,
) -> np.ndarray:
    """``new_tokens`` ids continuing ``prompt`` (1-D ids, at least one): greedy at temperature
    0, else sampled from softmax(logits / temperature) with a generator seeded by ``seed``
    (the same seed gives the same text). Only ids below ``vocab_limit`` are chosen; generation
    ends early at ``stop_token``. The context is the last ``seq_len`` tokens."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    ids = [int(t) for t in np.asarray(prompt).reshape(-1)]
    if not ids:
        raise ValueError("the prompt needs at least one token")
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(new_tokens):
        context = torch.tensor([ids[-model.seq_len :]], dtype=torch.int64)  # (1, T)
        logits = model.logits(context)[0, -1].double()  # (V,)
        if vocab_limit is not None:
            logits = logits[:vocab_limit]
        if temperature == 0:
            token = int(torch.argmax(logits))
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        if token == stop_token:
            break
        ids.append(token)
        out.append(token)
    return np.array(out, dtype=np.int64)
