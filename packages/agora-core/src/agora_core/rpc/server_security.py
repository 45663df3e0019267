"""The server side of an authorized run's transport, for one :class:`RpcServer`: its socket
made a CURVE server under a ZAP domain of its own, and the greeting's answer."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import zmq

from agora_core import world
from agora_core.auth.access import Access
from agora_core.auth.peer_identity import PeerIdentity
from agora_core.auth.security import HELLO_METHOD, TransportSecurity
from agora_core.auth.zap import zap_handler
from agora_core.errors import RpcError
from agora_core.rpc.server_calls import Handler
from agora_core.rpc.transport import context
from agora_core.wire.message import Kind, Message

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

    def screen(
        self, first: zmq.Frame, message: Message, handler: Handler | None, handlers: Iterable[Handler]
    ) -> tuple[PeerIdentity | None, Message | RpcError | None]:
        """Who sent the request ``message`` (its first frame names the connection's key, as the
        ZAP handler saw it), and an answer when the request goes no further: the greeting's
        reply, or why the caller may not call the method. ``(caller, None)``: serve it."""
        user_id = first.get("User-Id")
        if message.method == HELLO_METHOD:
            # answered at once by the server, not in a task: the calls the caller sends right
            # after it on the same connection must find it credentialed already
            answer = self.greet(user_id, message.meta, [h.access for h in handlers])
            if isinstance(answer, RpcError):
                return None, answer
            return None, Message(kind=Kind.RESPONSE, request_id=message.request_id, meta=answer)
        caller = self.security.caller(user_id, world.wall())
        refusal = handler.access.refusal(caller, message.method) if handler is not None else None
        return caller, refusal

    def greet(self, user_id: str | None, meta, accesses: list[Access]) -> dict | RpcError:
        """The answer to a greeting (our credential), or why the caller is refused. Callers
        without a credential are let through only to a server with methods open to them."""
        anonymous_ok = any(access.anonymous for access in accesses)
        try:
            return self.security.greet(user_id, meta, anonymous_ok=anonymous_ok)
        except RpcError as exc:
            return exc
