"""The stage's parameters as one flat vector, cut into P segments averaged in turn.

Every replica of a stage orders its parameters the same way (the module's declaration order),
so a flat index means the same weight everywhere. The vector is cut into blocks; a
permutation of the blocks derived from the run seed deals them to the P segments, so each
segment is a spread-out 1/P of the weights (round r averages segment r mod P) and reading or
writing one is a handful of contiguous copies.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

BLOCK_ELEMENTS = 4096  # granularity of the segment permutation


def _seed(run_seed: int, stage: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}/segments/{stage}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class SegmentLayout:
    def __init__(
        self, sizes: list[int], *, segments: int, run_seed: int, stage: int, block: int = BLOCK_ELEMENTS
    ):
        if segments < 1:
            raise ValueError("segments must be >= 1")
        self.sizes = sizes
        self.total = int(sum(sizes))
        self.segments = segments
        self.block = block
        blocks = -(-self.total // block)
        order = np.random.default_rng(_seed(run_seed, stage)).permutation(blocks)
        self._ranges: list[list[tuple[int, int]]] = []
        for segment in range(segments):
            chosen = np.sort(order[segment::segments])
            self._ranges.append([(int(b) * block, min(int(b + 1) * block, self.total)) for b in chosen])

    def ranges(self, segment: int) -> list[tuple[int, int]]:
        """The [start, stop) flat ranges of ``segment``, in order."""
        return self._ranges[segment % self.segments]

    def length(self, segment: int) -> int:
        return sum(stop - start for start, stop in self.ranges(segment))


class FlatParameters:
    """Reads and updates flat ranges of a list of tensors as if they were one vector."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.offsets = np.cumsum([0] + [t.numel() for t in tensors])

    def _pieces(self, ranges: list[tuple[int, int]]):
        """(tensor, start in tensor, stop in tensor, start in the gathered output) per overlap."""
        out = 0
        for start, stop in ranges:
            first = int(np.searchsorted(self.offsets, start, side="right")) - 1
            position = start
            index = first
            while position < stop:
                base = int(self.offsets[index])
                end = min(stop, int(self.offsets[index + 1]))
                if end > position:
                    yield self.tensors[index], position - base, end - base, out
                    out += end - position
                    position = end
                index += 1

    def read(self, ranges: list[tuple[int, int]]) -> np.ndarray:
        """A float32 copy of the values at ``ranges``, concatenated."""
        length = sum(stop - start for start, stop in ranges)
        values = np.empty(length, dtype=np.float32)
        with torch.no_grad():
            for tensor, lo, hi, out in self._pieces(ranges):
                flat = tensor.detach().reshape(-1)
                values[out : out + hi - lo] = flat[lo:hi].float().cpu().numpy()
        return values

    def add(self, ranges: list[tuple[int, int]], pieces: list[tuple[int, np.ndarray]]) -> None:
        """Add each piece (start, values) at positions [start, start + len(values)) of the vector
        ``read(ranges)`` gives. Pieces must not overlap; positions outside raise ValueError
        before anything is added."""
        windows = list(_windows(ranges, pieces))
        with torch.no_grad():
            for values, window in windows:
                update = torch.from_numpy(np.asarray(values, dtype=np.float32))
                for tensor, lo, hi, out in self._pieces(window):
                    flat = tensor.view(-1)
                    flat[lo:hi] += update[out : out + hi - lo].to(flat.device, flat.dtype)


def _windows(ranges: list[tuple[int, int]], pieces: list[tuple[int, np.ndarray]]):
    """(values, the flat ranges behind its positions) per piece, in one walk over ``ranges``."""
    index, position = 0, 0  # ranges[index] holds positions from ``position`` on
    for start, values in sorted(pieces, key=lambda piece: piece[0]):
        stop = start + len(values)
        while index < len(ranges) and position + ranges[index][1] - ranges[index][0] <= start:
            position += ranges[index][1] - ranges[index][0]
            index += 1
        window, at, cursor = [], index, position
        while cursor < stop:
            if at == len(ranges):
                raise ValueError(f"positions up to {stop} fall outside the {cursor} values of these ranges")
            lo, hi = ranges[at]
            first, last = max(start, cursor), min(stop, cursor + hi - lo)
            if first < last:
                window.append((lo + first - cursor, lo + last - cursor))
            cursor += hi - lo
            at += 1
        yield values, window
