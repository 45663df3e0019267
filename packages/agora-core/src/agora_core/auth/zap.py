"""The process's ZAP handler: the ZeroMQ authentication hook every CURVE server socket asks.

libzmq hands each new CURVE connection's client key to whoever serves
``inproc://zeromq.zap.01`` in the socket's context, and admits the connection only if the
answer is "200". One thread per process answers for every secured server in it (tests and
benchmarks run many nodes in one process); each server registers its ``domain`` and a policy
(client X25519 key -> admit?). An admitted connection's messages carry the client's key, in
hex, as their ``User-Id`` property: that is what the server reads to know who sent them.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

import zmq

from agora_core.observability.logs import get_logger

log = get_logger("auth.zap")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_POLL_MS = 200  # how often the thread looks whether it should stop

Policy = Callable[[bytes], bool]  # client X25519 key -> admit the connection


class ZapHandler:
    """Answers ZAP requests for the servers of one zmq context, on a thread of its own."""

    def __init__(self, context: zmq.Context):
        self._context = context
        self._policies: dict[bytes, Policy] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._serve, name="agora-zap", daemon=True)
        self._thread.start()
        self._bound.wait(5.0)
        if self._error is not None:
            raise self._error

    def register(self, domain: bytes, policy: Policy) -> None:
        with self._lock:
            if domain in self._policies:
                raise ValueError(f"ZAP domain {domain!r} is already registered")
            self._policies[domain] = policy

    def unregister(self, domain: bytes) -> None:
        with self._lock:
            self._policies.pop(domain, None)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        # version, request id, domain, address, routing id, mechanism, credentials...
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"bad ZAP request", b"", b""]
        request_id, domain, mechanism = request[1], request[2], request[5]
        with self._lock:
            policy = self._policies.get(domain)
        if policy is None or mechanism != b"CURVE" or len(request) < 7 or len(request[6]) != 32:
            return [b"1.0", request_id, b"400", b"not a secured agora server", b"", b""]
        client_key = request[6]
        try:
            admitted = policy(client_key)
        except Exception:  # a policy bug must not take the handler down: refuse, and say so
            log.exception("zap_policy_failed")
            admitted = False
        if not admitted:
            return [b"1.0", request_id, b"400", b"key refused", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", client_key.hex().encode(), b""]

    def _serve(self) -> None:
        try:
            sock = self._context.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            self._error = exc
            self._bound.set()
            return
        self._bound.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(_POLL_MS):
                    continue
                sock.send_multipart(self._answer(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)


_handlers: dict[int, ZapHandler] = {}
_handlers_lock = threading.Lock()


def zap_handler(context: zmq.Context) -> ZapHandler:
    """The ZAP handler of ``context``, started on first use."""
    with _handlers_lock:
        handler = _handlers.get(id(context))
        if handler is None or handler._stop.is_set():
            handler = _handlers[id(context)] = ZapHandler(context)
        return handler


@atexit.register
def _stop_all() -> None:
    with _handlers_lock:
        for handler in _handlers.values():
            handler.close()
        _handlers.clear()
