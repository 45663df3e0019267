"""Keys and credentials for the transport benchmark's authenticated figures.

The parent picks a throwaway authorizer and server key and hands their seeds to the server
processes in the environment (not on the command line, where ``ps`` would show them); each
side then issues itself a credential of the benchmark's run, as an authorized run's nodes hold.
The bare-CURVE baselines use the same server key, so both pay for the same cipher.
"""

from __future__ import annotations

import os

import zmq

from agora_core.auth.curve import curve_keypair, curve_public_key
from agora_core.auth.security import TransportSecurity
from agora_core.identity import NodeKey
from agora_devkit.authority import TestAuthority

RUN = "transport-benchmark"
AUTHORIZER_SEED_ENV = "AGORA_BENCH_AUTHORIZER_SEED"
SERVER_SEED_ENV = "AGORA_BENCH_SERVER_SEED"
CREDENTIAL_LIFETIME_S = 3600.0  # far longer than a run of the benchmark: no refresh mid-figure


def new_seeds() -> dict[str, str]:
    """Fresh authorizer and server seeds, as the environment the server processes get."""
    return {AUTHORIZER_SEED_ENV: os.urandom(32).hex(), SERVER_SEED_ENV: os.urandom(32).hex()}


def key_from_env(name: str, env: dict[str, str] | None = None) -> NodeKey:
    return NodeKey.from_seed(bytes.fromhex((env or os.environ)[name]))


def security_of(key: NodeKey, authorizer: NodeKey) -> TransportSecurity:
    """``key``'s side of the run: a worker credential signed by ``authorizer``, and a verifier."""
    authority = TestAuthority(RUN, authorizer)
    return authority.security(key, authority.credential(key, lifetime_s=CREDENTIAL_LIFETIME_S))


def curve_server(sock: zmq.Socket, key: NodeKey) -> None:
    """A bare CURVE server socket with ``key``'s X25519 keys (no ZAP: every client admitted)."""
    sock.curve_publickey, sock.curve_secretkey = curve_keypair(key)
    sock.curve_server = True


def curve_client(sock: zmq.Socket, server_public_key: bytes) -> None:
    """A CURVE client socket (a throwaway key of its own) for the node of that Ed25519 key."""
    public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = curve_public_key(server_public_key)
