"""Who may call a method, in an authorized run: the ``access`` a handler is registered with.

The default is any credentialed peer. A method can be opened to callers without one (the
authorizer's join methods, the transport's own greeting), or closed to all but some roles,
or a role on one stage (a worker's averaging streams: workers of its stage only). In an open
run nobody is authenticated and access is not checked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from agora_core.auth.peer_identity import AUTHORIZER_ROLE, PeerIdentity
from agora_core.errors import Forbidden, RpcError, Unauthenticated


@dataclass(frozen=True, slots=True)
class Access:
    anonymous: bool = False  # callers without a credential may call it too
    roles: frozenset[str] | None = None  # None: any credentialed role
    stage: int | None = None  # workers among the callers must hold a credential for this stage

    def refusal(self, identity: PeerIdentity | None, method: str) -> RpcError | None:
        """Why ``identity`` (None: an anonymous caller) may not call ``method``; None if it may."""
        if self.anonymous:
            return None
        if identity is None:
            return Unauthenticated(
                f"{method!r} needs a credential of this run: present one (the connection's "
                "greeting) before calling"
            )
        if self.roles is not None and identity.role not in self.roles:
            allowed = ", ".join(sorted(self.roles))
            return Forbidden(f"{method!r} is for {allowed} only; the caller is a {identity.role}")
        if self.stage is not None and identity.role == "worker" and identity.stage != self.stage:
            return Forbidden(
                f"{method!r} is for stage {self.stage}; the caller's credential is for stage {identity.stage}"
            )
        return None


ANYONE = Access(anonymous=True)
CREDENTIALED = Access()


def only(roles: Iterable[str], *, stage: int | None = None) -> Access:
    """Access for ``roles`` (and, with ``stage``, workers of that stage only)."""
    return Access(roles=frozenset(roles), stage=stage)


# Methods the operator runs (failure injection, shutdowns): the authorizer's key or an
# operator credential.
OPERATOR = only(("operator", AUTHORIZER_ROLE))
