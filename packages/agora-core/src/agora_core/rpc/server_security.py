"""The server side of an authorized run's transport, for one :class:`RpcServer`: its socket
made a CURVE server under a ZAP domain of its own, who sent each request (the key its
connection was made with), and the greeting, answered as it arrives."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import zmq

from agora_core.auth.access import Access
from agora_core.auth.peer_identity import PeerIdentity
from agora_core.auth.security import TransportSecurity
from agora_core.auth.zap import zap_handler
from agora_core.errors import RpcError
from agora_core.rpc.transport import context

_domains = itertools.count(1)  # one ZAP domain per secured server socket in the process


@dataclass(slots=True)
class Caller:
    """Who sent a request: its identity (None: no credential presented), its connection's key."""

    identity: PeerIdentity | None
    user_id: str

    @property
    def sender(self) -> str:
        return self.identity.node_id if self.identity is not None else ""


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

    def caller(self, first: zmq.Frame) -> Caller:
        """Who sent the message whose first frame is ``first``: the ZAP handler named its
        connection's CURVE key (``User-Id``), which the greeting tied to a credential."""
        user_id = first.get("User-Id")
        return Caller(self.security.caller(user_id, time.time()), user_id)

    def greet(self, caller: Caller, meta, accesses: list[Access]) -> dict | RpcError:
        """The answer to a greeting (our credential), or why the caller is refused. Callers
        without a credential are let through only to a server with methods open to them."""
        anonymous_ok = any(access.anonymous for access in accesses)
        try:
            return self.security.greet(caller.user_id, meta, anonymous_ok=anonymous_ok)
        except RpcError as exc:
            return exc
