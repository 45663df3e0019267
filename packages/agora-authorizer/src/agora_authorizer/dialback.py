"""The checks that dial the joiner back: reachability, key possession, bandwidth, compute.

The authorizer calls the address the request advertised: ``admission.prove`` with a fresh
nonce (the answer must be signed by the requesting key; its round trip, timed once the
connection is open, is the latency),
``admission.probe`` for ``bandwidth_probe_bytes`` random bytes (timed: bandwidth) and
``admission.challenge`` (the seeded matmul, timed; a few rows recomputed here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from agora_core import world
from agora_core.admission import JoinRequest, Refusal, RefusalReason
from agora_core.admission.answerer import PROVE_NONCE_BYTES, prove_message
from agora_core.admission.challenge import check_rows
from agora_core.config import AdmissionConfig
from agora_core.contract import Method
from agora_core.errors import AgoraError, PeerRefused
from agora_core.identity import verify_signature
from agora_core.rpc import RpcClient

DIAL_TIMEOUT_S = 10.0


@dataclass
class DialBackResult:
    refusal: Refusal | None = None
    measured: dict[str, float] = field(default_factory=dict)  # latency_ms, bandwidth_mbps, challenge_s


async def dial_back(
    client: RpcClient, request: JoinRequest, *, run: str, config: AdmissionConfig, challenge_width: int
) -> DialBackResult:
    """Dial the joiner at its advertised address and measure it; the connection is closed
    after. In an authorized run the joiner holds no credential yet: it must hold the key of
    its request (the handshake proves it), nothing more."""
    security = client.security
    if security is not None:
        security.expect(request.address, request.public_key, credentialed=False)
    try:
        return await _dial_back(client, request, run=run, config=config, challenge_width=challenge_width)
    finally:
        await client.disconnect(request.address)
        if security is not None:
            security.forget(request.address)


async def _dial_back(
    client: RpcClient, request: JoinRequest, *, run: str, config: AdmissionConfig, challenge_width: int
) -> DialBackResult:
    result = DialBackResult()
    measured = result.measured
    address = request.address
    nonce = world.token_bytes(PROVE_NONCE_BYTES)
    try:
        await client.connect(address)  # the connect is not part of the round trip timed next
        started = world.monotonic()
        reply = await client.call(address, Method.ADMISSION_PROVE, {"nonce": nonce}, timeout_s=DIAL_TIMEOUT_S)
        rtt = world.monotonic() - started
    except PeerRefused as exc:  # authorized run: the handshake showed another key is there
        result.refusal = Refusal(
            RefusalReason.KEY_MISMATCH, f"the node at {address} does not hold the request's key ({exc})"
        )
        return result
    except AgoraError as exc:
        result.refusal = Refusal(
            RefusalReason.UNREACHABLE,
            f"could not reach {address} ({type(exc).__name__}: {exc}); open the port, or advertise "
            "an address others can dial (--advertise)",
        )
        return result
    signature = reply.meta.get("signature") if isinstance(reply.meta, dict) else None
    if not isinstance(signature, bytes) or not verify_signature(
        request.public_key, prove_message(run, nonce), signature
    ):
        result.refusal = Refusal(
            RefusalReason.KEY_MISMATCH,
            f"{address} answered, but not with the key of node {request.node_id[:12]}",
        )
        return result
    measured["latency_ms"] = rtt * 1000.0
    if request.role != "worker":
        return result  # trainers: reachable and holding their key is all they must show
    if config.max_latency_ms and measured["latency_ms"] > config.max_latency_ms:
        result.refusal = Refusal(
            RefusalReason.LATENCY,
            f"round trip {measured['latency_ms']:.0f} ms to {address} exceeds this run's {config.max_latency_ms:g} ms",
        )
        return result
    try:
        if config.bandwidth_probe_bytes:
            started = world.monotonic()
            reply = await client.call(
                address, Method.ADMISSION_PROBE, {"bytes": config.bandwidth_probe_bytes}, timeout_s=60.0
            )
            elapsed = max(1e-6, world.monotonic() - started - rtt)  # the transfer, less a round trip
            probe = reply.tensors.get("probe")
            if not isinstance(probe, np.ndarray) or probe.nbytes != config.bandwidth_probe_bytes:
                result.refusal = Refusal(RefusalReason.BANDWIDTH, "the bandwidth probe came back short")
                return result
            measured["bandwidth_mbps"] = probe.nbytes * 8 / elapsed / 1e6
            if measured["bandwidth_mbps"] < config.min_bandwidth_mbps:
                result.refusal = Refusal(
                    RefusalReason.BANDWIDTH,
                    f"measured {measured['bandwidth_mbps']:.0f} Mbit/s from {address}; this run needs "
                    f"{config.min_bandwidth_mbps:g} Mbit/s",
                )
                return result
        seed = int.from_bytes(world.token_bytes(8), "big") >> 1  # 63 bits, unpredictable
        started = world.monotonic()
        timeout = max(DIAL_TIMEOUT_S, 3 * config.max_challenge_s)
        reply = await client.call(
            address, Method.ADMISSION_CHALLENGE, {"seed": seed, "n": challenge_width}, timeout_s=timeout
        )
        measured["challenge_s"] = world.monotonic() - started
    except AgoraError as exc:
        result.refusal = Refusal(RefusalReason.UNREACHABLE, f"{address} stopped answering the checks: {exc}")
        return result
    rows = reply.tensors.get("rows")
    rows_answer = rows.tobytes() if isinstance(rows, np.ndarray) and rows.dtype == np.uint8 else None
    if isinstance(reply.meta, dict) and isinstance(reply.meta.get("seconds"), (int, float)):
        measured["challenge_reported_s"] = float(reply.meta["seconds"])
    picks = world.rng().sample(range(challenge_width), min(config.challenge_rows_checked, challenge_width))
    correct = isinstance(rows_answer, bytes) and await world.offload(
        check_rows, seed, challenge_width, rows_answer, picks
    )
    if not correct:
        result.refusal = Refusal(
            RefusalReason.CHALLENGE_WRONG,
            f"the {challenge_width}x{challenge_width} matmul challenge came back wrong: the device "
            "does not compute what it claims",
        )
    elif config.max_challenge_s and measured["challenge_s"] > config.max_challenge_s:
        result.refusal = Refusal(
            RefusalReason.CHALLENGE_SLOW,
            f"the matmul challenge took {measured['challenge_s']:.2f} s; this run allows {config.max_challenge_s:g} s",
        )
    return result
