"""The donor side of state transfer: serve a consistent snapshot of this replica's state.

``state.manifest`` (``{"weights_only": true}``: without the AdamW state, for tools that export
the model) takes a snapshot on the compute thread (one copy, between two batches:
the replica keeps training), hashes every tensor off the event loop and answers with the
snapshot's id, step, tensor list and digests. ``state.fetch`` answers one byte range of one
tensor of that snapshot. Joiners taking part at the same time share a snapshot as long as the
replica has not stepped since it was taken. A snapshot nobody fetched from for
``snapshot_ttl_s`` is dropped, and at most ``MAX_SNAPSHOTS`` are held at once (the oldest
goes first), so a vanished joiner costs memory for one TTL at most.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.auth.access import only
from agora_core.config.lifecycle import JoinConfig
from agora_core.contract import Method
from agora_core.errors import BadRequest, NotServing
from agora_core.observability.logs import get_logger
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import Payload, Request, RpcServer
from agora_worker.serving.runtime import Runtime
from agora_worker.state.snapshot import StageState, StateSnapshot

log = get_logger("worker.donor")

MAX_SNAPSHOTS = 2


@dataclass
class _Held:
    snapshot: StateSnapshot
    weights_only: bool  # no AdamW state: for tools exporting the model
    last_used: float = field(
        default_factory=lambda: world.monotonic()
    )  # read late: the world may be simulated
    views: dict[str, np.ndarray] = field(default_factory=dict)  # name -> its bytes, flat uint8


def manifest_payload(snapshot_id: str, node_id: str, snapshot: StateSnapshot) -> Payload:
    """The manifest as it travels: names, dtypes and shapes in the header, the 32-byte
    digests as one (N, 32) uint8 tensor (a large stage's digests would crowd the header)."""
    specs = snapshot.specs()
    digests = np.frombuffer(b"".join(bytes.fromhex(snapshot.digest(s.name)) for s in specs), np.uint8)
    meta = {
        "snapshot": snapshot_id,
        "node_id": node_id,
        "step": snapshot.step,
        "tensors": [[s.name, s.dtype, list(s.shape)] for s in specs],
    }
    return Payload(meta, {"digests": digests.reshape(len(specs), 32)})


class StateDonor:
    def __init__(
        self,
        *,
        state: StageState,
        runtime: Runtime,
        config: JoinConfig,
        node_id: str,
        ready: Callable[[], bool],
        metrics: NodeMetrics,
    ):
        self._state = state
        self._runtime = runtime
        self._config = config
        self._node_id = node_id
        self._ready = ready
        self._held: dict[str, _Held] = {}
        self._taking = asyncio.Lock()  # joiners asking at once wait for one snapshot
        self._sweep: asyncio.TimerHandle | None = None
        self._m_served = metrics.counter(
            "agora_state_served_bytes_total", "State bytes served to joining replicas."
        )
        self._m_snapshots = metrics.counter(
            "agora_state_snapshots_total", "State snapshots taken for joiners."
        )

    def register(self, server: RpcServer, *, stage: int) -> None:
        """Serve the state to joining workers of ``stage`` (and the operator's export tools)."""
        access = only(("worker", "operator"), stage=stage)
        server.register(Method.STATE_MANIFEST, self._on_manifest, access=access)
        server.register(Method.STATE_FETCH, self._on_fetch, access=access)

    def close(self) -> None:
        """Drop every snapshot (the worker stops)."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._held.clear()

    def _expire(self) -> None:
        now = world.monotonic()
        for snapshot_id, held in list(self._held.items()):
            if now - held.last_used > self._config.snapshot_ttl_s:
                del self._held[snapshot_id]
                log.info("state_snapshot_dropped", snapshot=snapshot_id, reason="idle")

    def _swept(self) -> None:
        self._sweep = None
        self._expire()
        self._arm()

    def _arm(self) -> None:
        """While snapshots are held, look for idle ones every half TTL."""
        if self._sweep is None and self._held:
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_later(self._config.snapshot_ttl_s / 2, self._swept)

    async def _snapshot(self, *, weights_only: bool) -> tuple[str, _Held]:
        async with self._taking:
            self._expire()
            step = self._state.optimizer.step
            for snapshot_id, held in self._held.items():  # a full snapshot serves either kind
                if held.snapshot.step == step and (weights_only or not held.weights_only):
                    held.last_used = world.monotonic()
                    return snapshot_id, held
            started = world.monotonic()
            capture = functools.partial(self._state.capture, with_optimizer=not weights_only)
            snapshot = await asyncio.wrap_future(self._runtime.call(capture))
            copied_s = world.monotonic() - started
            await world.offload(snapshot.digests)  # hashing releases the GIL
            held = _Held(snapshot, weights_only=weights_only)
            held.views = {n: a.reshape(-1).view(np.uint8) for n, a in snapshot.tensors.items()}
            while len(self._held) >= MAX_SNAPSHOTS:
                oldest = min(self._held, key=lambda i: self._held[i].last_used)
                del self._held[oldest]
                log.info("state_snapshot_dropped", snapshot=oldest, reason="a newer one is needed")
            snapshot_id = world.token_hex(8)
            self._held[snapshot_id] = held
            self._arm()
            self._m_snapshots.inc()
            log.info(
                "state_snapshot_taken",
                snapshot=snapshot_id,
                step=snapshot.step,
                tensors=len(snapshot.tensors),
                bytes=snapshot.nbytes,
                copy_s=round(copied_s, 3),
                digest_s=round(world.monotonic() - started - copied_s, 3),
            )
            return snapshot_id, held

    async def _on_manifest(self, request: Request) -> Payload:
        if not self._ready():
            raise NotServing("this worker is still taking up its own state")
        meta = request.meta if isinstance(request.meta, dict) else {}
        snapshot_id, held = await self._snapshot(weights_only=meta.get("weights_only") is True)
        return manifest_payload(snapshot_id, self._node_id, held.snapshot)

    async def _on_fetch(self, request: Request) -> Payload:
        meta = request.meta if isinstance(request.meta, dict) else {}
        snapshot_id, name = meta.get("snapshot"), meta.get("name")
        offset, length = meta.get("offset"), meta.get("length")
        held = self._held.get(snapshot_id) if isinstance(snapshot_id, str) else None
        if held is None:
            raise BadRequest(f"no snapshot {str(snapshot_id)[:32]!r} here (dropped after an idle TTL?)")
        view = held.views.get(name) if isinstance(name, str) else None
        if view is None:
            raise BadRequest(f"snapshot {snapshot_id} has no tensor {str(name)[:128]!r}")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, length)):
            raise BadRequest("state.fetch needs int offset and length")
        if not (0 <= offset < max(1, view.nbytes) and 0 < length <= self._config.piece_bytes):
            raise BadRequest(
                f"range [{offset}, +{length}) is outside {name} ({view.nbytes} bytes) "
                f"or longer than a piece ({self._config.piece_bytes} bytes)"
            )
        held.last_used = world.monotonic()
        data = view[offset : offset + length]
        self._m_served.inc(data.nbytes)
        return Payload({"offset": offset}, {"data": data})
