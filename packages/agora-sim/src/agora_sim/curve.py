"""An authorized run's transport in the simulator. A client that expects a server's CURVE key
(its ``TransportSecurity`` knows one for the address) completes a CURVE handshake on connecting:
two more round trips, then the outcome ZeroMQ would reach. The server holds the key expected
of it, and its ZAP policy (``TransportSecurity.admits``) admits the client's key, or the
connection is rejected with the reason the ZeroMQ network gives; an open end meeting a
secured one breaks the handshake. Once admitted, every request names the client's key as
its ``User-Id`` (as every frame of a ZeroMQ message does), so the server's guard reads its
callers exactly as over ZeroMQ. Nothing is encrypted: the bytes never leave the process."""

from __future__ import annotations

from agora_core.rpc.network import BROKEN_HANDSHAKE, KEY_REFUSED, WRONG_KEY
from agora_sim.frames import CallerFrame

SECURE_HANDSHAKE_ROUND_TRIPS = 2  # a CURVE handshake's, after the TCP connection's own


def handshake(connection, server) -> str:
    """Why a connection's secure handshake fails ("": it succeeds, or neither end is secured),
    in the ZeroMQ network's words for each failure. On success the connection names the
    client's key as the server's ZAP policy admitted it."""
    guard, security = server.guard, connection.client.security
    if guard is None and connection.server_key is None:
        return ""  # an open run
    if guard is None or connection.server_key is None or security is None:
        return BROKEN_HANDSHAKE
    if guard.security.curve_public != connection.server_key:
        return WRONG_KEY
    if not guard.security.admits(security.curve_public):
        return KEY_REFUSED
    connection.user_id = security.curve_public.hex()
    return ""


def caller_frame(connection) -> CallerFrame:
    """The connection's identity frame as a secured server receives it: naming the caller."""
    frame = CallerFrame(connection.identity)
    frame.user_id = connection.user_id
    return frame
