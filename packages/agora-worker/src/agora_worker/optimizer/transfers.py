"""Host <-> device transfers of a stage's trained weights: once per optimizer step each way.

The compute copy of the trained weights lives on the device, the fp32 master copy and AdamW in
host memory (``optimizer``). Gradients stay on the device over all microbatches of a step. At
the step they cross to the host once, into pinned buffers, in buckets of about
``bucket_bytes``: every bucket's copy is queued at once, non-blocking, on a side stream, and
the host's AdamW takes a bucket as soon as its copy has landed while later buckets are still
crossing. Each updated bucket goes straight back (pinned, non-blocking, on a second side
stream, so the two directions overlap each other and the host's arithmetic), and the compute
stream waits for the last upload on the device, not the host: the compute thread queues the
next microbatch at once and its kernels start when the weights are in place. Averaging's and
a state install's writes to the masters reach the device the same way, as one upload.

Device-agnostic: without a CUDA device the same code runs on plain host buffers with no
streams (a copy is done when issued), so CPU tests exercise it with ``separate_master``.

A compute copy in another dtype (bf16 compute weights) is narrowed on the device: its masters
cross in fp32 through a small staging buffer, since torch converts a cross-device copy between
two dtypes on the host, in pageable memory, which would block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

MiB = 1 << 20
BUCKET_BYTES = 32 * MiB  # one landing event and one AdamW call per bucket
STAGING_BYTES = 32 * MiB  # device buffer a narrowing upload crosses through, chunk by chunk


@dataclass
class TransferCounts:
    """Running totals. A transfer moves a whole set at once: the step's gradients (to the
    host) or the weights (to the device), however many tensors that is."""

    to_host: int = 0  # gradient transfers: one per applied step
    to_device: int = 0  # weight transfers: one per applied step, averaging update or install
    tensors_to_host: int = 0
    tensors_to_device: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    wait_s: float = 0.0  # the host blocked on copies: gradients landing, an upload still reading


def bucket_indices(sizes_bytes: Sequence[int], bucket_bytes: int) -> list[list[int]]:
    """Consecutive indices grouped into buckets of at most ``bucket_bytes`` (a larger tensor
    gets a bucket of its own)."""
    buckets: list[list[int]] = []
    filled = 0
    for index, size in enumerate(sizes_bytes):
        if not buckets or filled + size > bucket_bytes:
            buckets.append([])
            filled = 0
        buckets[-1].append(index)
        filled += size
    return buckets


class TransferEngine:
    """The host side of a compute copy: fp32 masters, gradient buffers, and the copies between.

    One owner: the compute thread (under the optimizer's lock). ``masters[i]`` and
    ``grads[i]`` are host tensors of ``compute[i]``'s shape, pinned where CUDA is the device.
    """

    def __init__(self, compute: Sequence[torch.Tensor], *, bucket_bytes: int = BUCKET_BYTES):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
        self.compute = list(compute)
        devices = {p.device for p in self.compute}
        if len(devices) > 1:
            raise ValueError(f"the compute copy must live on one device, found {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        with torch.no_grad():
            self.masters = [nn.Parameter(self._host(p.shape).copy_(p.detach())) for p in self.compute]
        self.grads = [self._host(p.shape) for p in self.compute]
        self.buckets = bucket_indices([m.numel() * m.element_size() for m in self.masters], bucket_bytes)
        self.counts = TransferCounts()
        self._uploaded: torch.cuda.Event | None = None  # the last upload's end (CUDA)
        self._staging: torch.Tensor | None = None
        if self.cuda:
            self._down = torch.cuda.Stream(self.device)
            self._up = torch.cuda.Stream(self.device)

    def _host(self, shape: torch.Size) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.float32, pin_memory=self.cuda)

    def _wait(self, event: torch.cuda.Event) -> None:
        started = time.perf_counter()
        event.synchronize()
        self.counts.wait_s += time.perf_counter() - started

    # --- gradients: device -> host ----------------------------------------------------------------

    def gradients_to_host(self, grads: Sequence[torch.Tensor | None]) -> Iterator[list[int]]:
        """Copy the step's gradients (fp32, on the device; None for a weight that got none) into
        ``self.grads``; yields each bucket's indices that have one, once its copies landed.
        The caller keeps ``grads`` alive until the iteration ends."""
        buckets = [[i for i in bucket if grads[i] is not None] for bucket in self.buckets]
        buckets = [bucket for bucket in buckets if bucket]
        if not buckets:
            return
        self.counts.to_host += 1
        for bucket in buckets:
            for i in bucket:
                self.counts.tensors_to_host += 1
                self.counts.bytes_to_host += self.grads[i].nbytes
        if not self.cuda:
            for bucket in buckets:
                for i in bucket:
                    self.grads[i].copy_(grads[i])
                yield bucket
            return
        self._down.wait_stream(torch.cuda.current_stream(self.device))  # the backward is done
        landed = []
        with torch.cuda.stream(self._down):
            for bucket in buckets:
                for i in bucket:
                    self.grads[i].copy_(grads[i], non_blocking=True)
                landed.append(self._down.record_event())
        for bucket, event in zip(buckets, landed, strict=True):
            self._wait(event)
            yield bucket

    # --- weights: host -> device ------------------------------------------------------------------

    @contextlib.contextmanager
    def upload(self) -> Iterator[Callable[[Sequence[int]], None]]:
        """One weight transfer: ``send(indices)`` queues those masters' copies into the compute
        copy; when the block ends the compute stream waits for them (on the device)."""
        self.counts.to_device += 1
        if self.cuda:  # the microbatches queued so far read the old weights: copy after them
            self._up.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.no_grad():
                yield self._send
        finally:
            if self.cuda:
                self._uploaded = self._up.record_event()
                torch.cuda.current_stream(self.device).wait_event(self._uploaded)

    def upload_all(self) -> None:
        with self.upload() as send:
            for bucket in self.buckets:
                send(bucket)

    def _send(self, indices: Sequence[int]) -> None:
        for i in indices:
            master, compute = self.masters[i].detach(), self.compute[i].detach()
            self.counts.tensors_to_device += 1
            self.counts.bytes_to_device += master.nbytes
            if not self.cuda:
                compute.copy_(master)
            elif compute.dtype == master.dtype:
                with torch.cuda.stream(self._up):
                    compute.copy_(master, non_blocking=True)
            else:
                self._send_narrowed(master, compute)

    def _send_narrowed(self, master: torch.Tensor, compute: torch.Tensor) -> None:
        """fp32 master -> compute copy of another dtype, cast on the device chunk by chunk; the
        stream's order keeps one chunk's cast ahead of the next chunk's copy into staging."""
        with torch.cuda.stream(self._up):
            if self._staging is None:
                self._staging = torch.empty(STAGING_BYTES // 4, dtype=torch.float32, device=self.device)
            source, target = master.view(-1), compute.view(-1)
            chunk = self._staging.numel()
            for start in range(0, source.numel(), chunk):
                stop = min(start + chunk, source.numel())
                staging = self._staging[: stop - start]
                staging.copy_(source[start:stop], non_blocking=True)
                target[start:stop].copy_(staging)

    def settle(self) -> None:
        """Block until the last upload has read the masters: call before changing them."""
        if self._uploaded is not None:
            self._wait(self._uploaded)
            self._uploaded = None
