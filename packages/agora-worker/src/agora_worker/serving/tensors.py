"""Tensors on the wire: checks on those a request carries, before it may queue for compute,
and the computed results cut back into each caller's share.

Requests stay numpy arrays until the compute thread merges a batch (one ``np.concatenate``
and one ``torch.from_numpy`` per input), which keeps per-request work off the event loop.
A bfloat16 result (``transport.boundary_dtype = "bf16"``) travels as a TaggedArray of its
2-byte words; a receiving stage widens it back to float32 exactly.
"""

from __future__ import annotations

import numpy as np
import torch

from agora_core.errors import BadRequest
from agora_core.wire.dtypes import TaggedArray, Tensor, bfloat16_to_float32

INTEGER_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))
FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


def split_samples(tensor: torch.Tensor, bounds: np.ndarray) -> list[Tensor]:
    """A computed (B, ...) tensor cut along its samples at ``bounds``, as host arrays ready for
    the wire: numpy for the dtypes numpy has, bfloat16 as tagged words."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        words = tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
        return [TaggedArray("bfloat16", part) for part in np.split(words, bounds)]
    return np.split(tensor.numpy(), bounds)


def token_ids(
    name: str, array: Tensor | None, *, vocab_size: int, max_batch: int, max_len: int
) -> np.ndarray:
    """Check a (B, T) array of token ids; returns int64."""
    if array is None:
        raise BadRequest(f"missing tensor {name!r}")
    if not isinstance(array, np.ndarray) or array.dtype not in INTEGER_DTYPES:
        raise BadRequest(
            f"{name!r} must be int32 or int64 token ids, got {getattr(array, 'dtype', type(array))}"
        )
    if array.ndim != 2 or not 1 <= array.shape[0] <= max_batch or not 1 <= array.shape[1] <= max_len:
        raise BadRequest(
            f"{name!r} must have shape (B, T) with 1 <= B <= {max_batch} and 1 <= T <= {max_len}, "
            f"got {tuple(array.shape)}"
        )
    if array.min() < 0 or array.max() >= vocab_size:
        raise BadRequest(f"{name!r} holds ids outside [0, {vocab_size})")
    return array.astype(np.int64, copy=False)


def activations(name: str, array: Tensor | None, *, shape: tuple[int, ...]) -> np.ndarray:
    """Check a boundary payload or gradient of the expected shape; returns float32."""
    if array is None:
        raise BadRequest(f"missing tensor {name!r}")
    if isinstance(array, TaggedArray):
        if array.dtype != "bfloat16":
            raise BadRequest(f"{name!r} must be float32, bfloat16 or float16, got {array.dtype}")
        values = bfloat16_to_float32(array.words)
    elif isinstance(array, np.ndarray) and array.dtype in FLOAT_DTYPES:
        values = array.astype(np.float32, copy=False)
    else:
        raise BadRequest(
            f"{name!r} must be float32, bfloat16 or float16, got {getattr(array, 'dtype', type(array))}"
        )
    if tuple(values.shape) != shape:
        raise BadRequest(f"{name!r} must have shape {shape}, got {tuple(values.shape)}")
    if not np.isfinite(values).all():
        raise BadRequest(f"{name!r} holds NaN or infinite values")
    return values
