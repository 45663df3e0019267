"""The compute challenge: a seeded matmul at the run's stage width, checked a few rows at a time.

The authorizer sends a fresh seed and the width ``n``; the node multiplies two n x n
matrices of small integers (exact in float32 up to a width of a million, so any device gets
the same bits) and returns one 8-byte digest per row of the product. The authorizer
recomputes a few rows it picks at random after the answer came back and compares; the time
it measured between asking and the answer is what the speed threshold is held against (a
node cannot report a shorter one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from agora_core.config.admission import CHALLENGE_MAX_WIDTH as MAX_WIDTH

ROW_DIGEST_BYTES = 8


def challenge_matrices(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The two float32 matrices of challenge ``seed``: integers in [-4, 4]."""
    if not 1 <= n <= MAX_WIDTH:
        raise ValueError(f"challenge width must lie in [1, {MAX_WIDTH}], got {n}")
    rng = np.random.Generator(np.random.PCG64(seed))
    a = rng.integers(-4, 5, size=(n, n), dtype=np.int8).astype(np.float32)
    b = rng.integers(-4, 5, size=(n, n), dtype=np.int8).astype(np.float32)
    return a, b


def row_digests(product: np.ndarray) -> bytes:
    """Concatenated per-row digests of an integer-valued product."""
    exact = np.ascontiguousarray(product.astype(np.int32))
    return b"".join(hashlib.blake2b(row.tobytes(), digest_size=ROW_DIGEST_BYTES).digest() for row in exact)


def answer_challenge(
    seed: int, n: int, matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul
) -> bytes:
    """What a node returns: the row digests of A @ B, computed with ``matmul`` (a worker
    passes one that runs on its device)."""
    a, b = challenge_matrices(seed, n)
    return row_digests(np.asarray(matmul(a, b)))


def check_rows(seed: int, n: int, answer: bytes, rows: list[int]) -> bool:
    """Whether ``answer`` holds the right digest for each of ``rows``."""
    if len(answer) != n * ROW_DIGEST_BYTES:
        return False
    a, b = challenge_matrices(seed, n)
    expected = row_digests(a[rows] @ b)
    return all(
        answer[r * ROW_DIGEST_BYTES : (r + 1) * ROW_DIGEST_BYTES]
        == expected[i * ROW_DIGEST_BYTES : (i + 1) * ROW_DIGEST_BYTES]
        for i, r in enumerate(rows)
    )
