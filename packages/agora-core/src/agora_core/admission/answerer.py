"""The joining node's side of the authorizer's dial-back: prove the key, send bytes, compute.

The authorizer dials the address a join request advertised and asks three things: a
signature over a fresh nonce (reachability, and possession of the requesting key), a blob of
random bytes of the size it names (it times the transfer: bandwidth), and the compute
challenge (:mod:`agora_core.admission.challenge`). A node serves these on its ordinary RPC
port from before it asks to join until it has its credential.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from agora_core import world
from agora_core.admission.challenge import MAX_WIDTH, answer_challenge
from agora_core.auth.access import only
from agora_core.auth.peer_identity import AUTHORIZER_ROLE
from agora_core.contract import Method
from agora_core.errors import BadRequest
from agora_core.identity import NodeKey
from agora_core.rpc import Payload, Request, RpcServer

PROVE_CONTEXT = b"agora-admission-prove-v1"
MAX_PROBE_BYTES = 64 * 1024 * 1024
PROVE_NONCE_BYTES = 32


def prove_message(run: str, nonce: bytes) -> bytes:
    """What a joining node signs to prove it holds its key, for run ``run``."""
    return PROVE_CONTEXT + b"\0" + run.encode() + b"\0" + nonce


class DialBackAnswerer:
    """Serves ``admission.prove``, ``admission.probe`` and ``admission.challenge`` while the
    node is joining (``active``); an admitted node sets it False, and then refuses them, so
    nobody can make it compute or send bulk bytes for the asking. Requests beyond what the
    run's authorizer asks (``max_width``, ``max_probe_bytes``) are refused."""

    def __init__(
        self,
        key: NodeKey,
        run: str,
        matmul: Callable[[np.ndarray, np.ndarray], np.ndarray] = np.matmul,
        *,
        max_width: int = MAX_WIDTH,
        max_probe_bytes: int = MAX_PROBE_BYTES,
    ):
        self.key = key
        self.run = run
        self.matmul = matmul  # a worker passes one that runs on its device
        self.max_width = min(max_width, MAX_WIDTH)
        self.max_probe_bytes = min(max_probe_bytes, MAX_PROBE_BYTES)
        self.active = True
        self.challenges = 0
        self._computing = asyncio.Lock()  # one challenge at a time

    def _check_active(self) -> None:
        if not self.active:
            raise BadRequest("this node is not joining: the admission dial-back is closed")

    def register(self, server: RpcServer) -> None:
        # the authorizer dials back before this node holds a credential: only its key may ask
        access = only((AUTHORIZER_ROLE,))
        server.register(Method.ADMISSION_PROVE, self._on_prove, access=access)
        server.register(Method.ADMISSION_PROBE, self._on_probe, access=access)
        server.register(Method.ADMISSION_CHALLENGE, self._on_challenge, access=access)

    async def _on_prove(self, request: Request) -> Payload:
        self._check_active()
        nonce = request.meta.get("nonce") if isinstance(request.meta, dict) else None
        if not isinstance(nonce, bytes) or len(nonce) != PROVE_NONCE_BYTES:
            raise BadRequest(f"admission.prove needs {{'nonce': {PROVE_NONCE_BYTES} bytes}}")
        return Payload(
            {"signature": self.key.sign(prove_message(self.run, nonce)), "node_id": self.key.node_id}
        )

    async def _on_probe(self, request: Request) -> Payload:
        self._check_active()
        size = request.meta.get("bytes") if isinstance(request.meta, dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= self.max_probe_bytes:
            raise BadRequest(f"admission.probe needs {{'bytes': n}} with 0 <= n <= {self.max_probe_bytes}")
        # random bytes, as a tensor (bulk data travels in frames): no compression shrinks them
        return Payload({"bytes": size}, {"probe": np.frombuffer(world.token_bytes(size), dtype=np.uint8)})

    async def _on_challenge(self, request: Request) -> Payload:
        self._check_active()
        meta = request.meta if isinstance(request.meta, dict) else {}
        seed, n = meta.get("seed"), meta.get("n")
        if not isinstance(seed, int) or not isinstance(n, int) or not 1 <= n <= self.max_width or seed < 0:
            raise BadRequest(f"admission.challenge needs {{'seed': int >= 0, 'n': 1..{self.max_width}}}")
        async with self._computing:
            started = world.monotonic()
            rows = await world.offload(answer_challenge, seed, n, self.matmul)
            elapsed = world.monotonic() - started
        self.challenges += 1
        return Payload({"seconds": elapsed}, {"rows": np.frombuffer(rows, dtype=np.uint8)})
