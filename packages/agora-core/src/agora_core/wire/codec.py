"""Per-chunk LZ4 policy: compress a chunk only when that pays.

Deciding by compressing the whole chunk would cost a full LZ4 pass on data that does not
compress (random-looking floats, the common case for weights and activations). Instead we
compress a small sample taken from three places in the chunk; only if the sample shrinks well
do we compress the chunk, and we still send it raw if the full result did not shrink enough.
"""

from __future__ import annotations

from dataclasses import dataclass

import lz4.block

CODEC_RAW = 0
CODEC_LZ4 = 1
CODECS = (CODEC_RAW, CODEC_LZ4)


@dataclass(kw_only=True, frozen=True)
class CompressionPolicy:
    enabled: bool = True
    # Chunks smaller than this are always sent raw: the saving cannot beat the call overhead.
    min_chunk_bytes: int = 4096
    # Bytes sampled from each of the start, middle and end of a chunk to predict its ratio.
    sample_window_bytes: int = 4096
    # Compress the whole chunk only if the sample compresses to at most this fraction ...
    sample_ratio_max: float = 0.8
    # ... and keep the compressed form only if the whole chunk shrank to at most this fraction.
    keep_ratio_max: float = 0.9

    def __post_init__(self) -> None:
        if self.min_chunk_bytes < 0 or self.sample_window_bytes <= 0:
            raise ValueError("min_chunk_bytes must be >= 0 and sample_window_bytes > 0")
        if not (0 < self.sample_ratio_max <= 1 and 0 < self.keep_ratio_max <= 1):
            raise ValueError("compression ratios must lie in (0, 1]")


def _sample(chunk: memoryview, window: int) -> bytes:
    n = len(chunk)
    if n <= 3 * window:
        return bytes(chunk)
    mid = (n - window) // 2
    return b"".join((chunk[:window], chunk[mid : mid + window], chunk[n - window :]))


def encode_chunk(chunk: memoryview, policy: CompressionPolicy) -> tuple[int, memoryview | bytes]:
    """Return ``(codec, payload)``: the chunk itself (zero-copy) or its LZ4 block."""
    n = len(chunk)
    if not policy.enabled or n < policy.min_chunk_bytes:
        return CODEC_RAW, chunk
    sample = _sample(chunk, policy.sample_window_bytes)
    if len(lz4.block.compress(sample, store_size=False)) > policy.sample_ratio_max * len(sample):
        return CODEC_RAW, chunk
    packed = lz4.block.compress(chunk, store_size=False)
    if len(packed) > policy.keep_ratio_max * n:
        return CODEC_RAW, chunk
    return CODEC_LZ4, packed


def decode_lz4(payload, raw_size: int) -> bytes:
    """Decompress one LZ4 chunk whose original size the (already validated) header declared.

    Raises ``ValueError`` when the block is corrupt or does not expand to exactly ``raw_size``.
    """
    out = lz4.block.decompress(payload, uncompressed_size=raw_size)
    if len(out) != raw_size:
        raise ValueError(f"LZ4 chunk expanded to {len(out)} bytes, header declared {raw_size}")
    return out
