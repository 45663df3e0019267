"""The validation split as samples, and a loss per token as bits per byte.

A loss per token depends on the tokenizer (a BPE token carries several bytes of text, a byte
token one), so it compares runs of one tokenizer only. Bits per byte compare any two:

    bits/byte = (total nats over the scored tokens) / (ln 2 * UTF-8 bytes those tokens stand for)

where a token's bytes come from its tokenizer (``Tokenizer.token_bytes``; the separator stands
for none). Here every scored sample has the same number of label tokens, so the total nats are
the mean loss per token times the number of label tokens.
"""

from __future__ import annotations

import math

import numpy as np

from agora_trainer.data.shards import ShardSet
from agora_trainer.errors import ShardError


def validation_samples(shard_set: ShardSet, seq_len: int, count: int) -> np.ndarray:
    """(N, seq_len + 1) samples spread evenly over every shard of ``shard_set``, N <= count."""
    per_shard = [s.sample_count(seq_len) for s in shard_set.shards]
    available = sum(per_shard)
    if available == 0:
        names = ", ".join(s.name for s in shard_set.shards)
        raise ShardError(
            f"the validation split of {shard_set.directory} ({names}) is shorter than one sample of {seq_len} tokens"
        )
    starts = np.cumsum([0, *per_shard])
    picks = np.unique(np.linspace(0, available - 1, min(count, available)).round().astype(np.int64))
    samples = []
    for pick in picks:
        shard = int(np.searchsorted(starts, pick, side="right")) - 1
        samples.append(shard_set.shards[shard].sample(int(pick - starts[shard]), seq_len))
    return np.stack(samples)


def label_bytes(samples: np.ndarray, token_bytes: np.ndarray) -> int:
    """UTF-8 bytes of text the samples' label tokens (all but each sample's first) stand for."""
    return int(token_bytes[samples[:, 1:].astype(np.int64)].sum())


def bits_per_byte(mean_loss_nats: float, samples: np.ndarray, token_bytes: np.ndarray) -> float:
    """The loss of ``samples`` (mean nats per label token) in bits per byte of their text."""
    tokens = samples.shape[0] * (samples.shape[1] - 1)
    text_bytes = label_bytes(samples, token_bytes)
    if text_bytes == 0:
        raise ShardError("the scored samples stand for no text (only separators)")
    return mean_loss_nats * tokens / (math.log(2) * text_bytes)
