"""The server side of an authorized run's transport, for one :class:`RpcServer`: its socket
made a CURVE server under a ZAP domain of its own, and the greeting's answer."""

from __future__ import annotations

import itertools

import zmq

from agora_core.auth.access import Access
from agora_core.auth.security import TransportSecurity
from agora_core.auth.zap import zap_handler
from agora_core.errors import RpcError
from agora_core.rpc.transport import context

_domains = itertools.count(1)  # one ZAP domain per secured server socket in the process


class ServerSecurity:
    def __init__(self, security: TransportSecurity):
        self.security = security
        self._zap_domain: bytes | None = None

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server whose connections the process's ZAP handler admits."""
        self._zap_domain = b"agora-%d" % next(_domains)
        zap_handler(context()).register(self._zap_domain, self.security.admits)
        sock.curve_server = True
        sock.curve_secretkey = self.security.curve_secret
        sock.curve_publickey = self.security.curve_public
        sock.zap_domain = self._zap_domain

    def close(self) -> None:
        if self._zap_domain is not None:
            zap_handler(context()).unregister(self._zap_domain)
            self._zap_domain = None

    def greet(self, user_id: str | None, meta, accesses: list[Access]) -> dict | RpcError:
        """The answer to a greeting (our credential), or why the caller is refused. Callers
        without a credential are let through only to a server with methods open to them."""
        anonymous_ok = any(access.anonymous for access in accesses)
        try:
            return self.security.greet(user_id, meta, anonymous_ok=anonymous_ok)
        except RpcError as exc:
            return exc
