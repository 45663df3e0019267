"""Helpers for tests that drive workers over the RPC (test modules cannot import each other)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agora_core.rpc import Payload, RpcClient


@dataclass(frozen=True)
class PipelinePass:
    """The replies of one batch trained through a head, a body and a tail."""

    head: Payload  # forward of stage 0: its boundary
    body: Payload  # forward of stage 1: its boundary
    tail: Payload  # forward_backward of stage 2: losses and the gradient for its input
    back: Payload  # backward of stage 1: the gradient for its input
    done: Payload  # backward of stage 0: nothing


async def train_one_pass(
    client: RpcClient, addresses: Sequence[str], tokens: np.ndarray, labels: np.ndarray
) -> PipelinePass:
    """Route ``tokens`` (B, T) through three workers, stages 0, 1, 2 at ``addresses``, as a
    trainer lane does: forwards in order, the tail's forward_backward, backwards in reverse."""
    head_at, body_at, tail_at = addresses
    head = await client.call(head_at, "forward", {"stage": 0}, {"tokens": tokens})
    body = await client.call(
        body_at, "forward", {"stage": 1}, {"tokens": tokens, "boundary": head.tensors["boundary"]}
    )
    tail = await client.call(
        tail_at,
        "forward_backward",
        {"stage": 2},
        {"tokens": tokens, "boundary": body.tensors["boundary"], "labels": labels},
    )
    back = await client.call(
        body_at,
        "backward",
        {"stage": 1},
        {"tokens": tokens, "boundary": head.tensors["boundary"], "grad": tail.tensors["grad"]},
    )
    done = await client.call(
        head_at, "backward", {"stage": 0}, {"tokens": tokens, "grad": back.tensors["grad"]}
    )
    return PipelinePass(head, body, tail, back, done)
