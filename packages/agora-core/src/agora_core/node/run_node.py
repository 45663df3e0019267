"""The networking every role of a run shares: one RPC port, a client, and a DHT membership.

Workers, trainers, the authorizer and (later) the monitor each hold one :class:`RunNode`:
their own RPC methods and the DHT's are served on the same port, and the DHT enforces the
run's value schemas (``agora_core.schema``, and in an authorized run the revocation list's
owner) on everything it stores. The port can be bound before the DHT is joined
(:meth:`RunNode.serve`): an authorized node answers the authorizer's dial-back there while it
waits to be admitted.

In an authorized run every connection is authenticated (:mod:`agora_core.auth`): the node
presents its credential (:meth:`RunNode.set_credential`, once admitted), and dials only
nodes whose key it knows — a bootstrap address names it (``<hex key>@host:port``), the DHT's
member table knows every member's, the run config the authorizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agora_core.admission.credential import SignedCredential
from agora_core.admission.revocations import Revocations
from agora_core.auth import PeerVerifier
from agora_core.auth.security import TransportSecurity, parse_peer_address
from agora_core.config import RunConfig
from agora_core.config.run import TransportConfig
from agora_core.dht import DhtNode, Validators
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.observability.metrics import NodeMetrics
from agora_core.rpc import RpcClient, RpcConfig, RpcServer
from agora_core.rpc.linkemu import LinkEmulator
from agora_core.schema import register_validators
from agora_core.wire.addresses import normalize_address
from agora_core.wire.codec import CompressionPolicy
from agora_core.wire.message import WireConfig, WireLimits


def rpc_config(transport: TransportConfig, **overrides: Any) -> RpcConfig:
    """The RPC settings a run config's ``[transport]`` section asks for (``overrides`` win)."""
    wire = WireConfig(
        chunk_bytes=transport.chunk_bytes,
        compression=CompressionPolicy(enabled=transport.compression),
        limits=WireLimits(max_message_bytes=transport.max_message_bytes),
    )
    settings = {
        "wire": wire,
        "default_timeout_s": transport.request_timeout_s,
        "connect_timeout_s": transport.connect_timeout_s,
        "stream_window": transport.stream_window,
    }
    return RpcConfig(**{**settings, **overrides})


def transport_security(
    run: RunConfig, key: NodeKey, credential: Callable[[], Any] = lambda: None
) -> TransportSecurity | None:
    """The transport security of node ``key`` in ``run`` (None in an open run); ``credential``
    returns the node's current credential value (None while it has none)."""
    if not run.admission.authorized:
        return None
    verifier = PeerVerifier(
        run=run.name,
        authorizer_key=run.admission.authorizer_key_bytes,
        max_clock_skew_s=run.admission.max_clock_skew_s,
    )
    return TransportSecurity(
        key=key, verifier=verifier, credential=credential, max_clock_skew_s=run.admission.max_clock_skew_s
    )


class RunNode:
    def __init__(
        self,
        *,
        run: RunConfig,
        key: NodeKey,
        metrics: NodeMetrics,
        listen: str = "127.0.0.1:0",
        bootstrap: Sequence[str] = (),
        advertise: str | None = None,
        link: LinkEmulator | None = None,
        authorizer: str | None = None,
        credential: SignedCredential | None = None,
    ):
        """``bootstrap``: DHT members to join through (``<hex key>@host:port`` in an
        authorized run); ``authorizer``: the authorizer's address (it is a member too);
        ``credential``: this node's, when it has one already (a DHT seed's, a tool's)."""
        self.key = key
        self.metrics = metrics
        self.credential: SignedCredential | None = credential
        self.security = transport_security(run, key, self.credential_value)
        addresses = self._bootstrap(run, bootstrap, authorizer)
        rpc = rpc_config(run.transport)
        self.server = RpcServer(
            listen=listen, config=rpc, link=link, metrics=metrics, node_id=key.node_id, security=self.security
        )
        self.client = RpcClient(
            config=rpc, link=link, metrics=metrics, node_id=key.node_id, security=self.security
        )
        validators = Validators()
        register_validators(validators, run.name, run.admission.authorizer_key_bytes)
        self.dht = DhtNode(
            key=key,
            config=run.dht,
            bootstrap=addresses,
            advertise=advertise,
            server=self.server,
            client=self.client,
            metrics=metrics,
            validators=validators,
            # an authorized run's members hold credentials; claims without one are refused
            verifier=None if self.security is None else self.security.verifier,
            credential=self.credential_value,
        )
        if self.security is not None:
            self.security.add_resolver(self.dht.key_for_address)  # members' keys, for dialing
        if credential is not None:
            self._credential_metrics(credential)

    def _bootstrap(self, run: RunConfig, bootstrap: Sequence[str], authorizer: str | None) -> list[str]:
        """The bootstrap addresses, their keys noted for the secure transport."""
        addresses = []
        for spec in bootstrap:
            try:
                address, public_key = parse_peer_address(spec)
            except ValueError as exc:
                raise ConfigError("--bootstrap", str(exc)) from None
            address = normalize_address(address)
            if self.security is not None:
                if public_key is None:
                    raise ConfigError(
                        "--bootstrap",
                        f"{spec}: in an authorized run a bootstrap address names its node's public "
                        "key, as <64 hex digits>@host:port",
                    )
                self.security.expect(address, public_key)
            addresses.append(address)
        if authorizer and self.security is not None:
            address = normalize_address(authorizer)
            self.security.expect(address, run.admission.authorizer_key_bytes, credentialed=False)
            if address not in addresses:
                addresses.append(address)  # the authorizer is a member: it can let a node in too
        return addresses

    def credential_value(self) -> Any:
        """This node's credential as the wire carries it (None before it has one)."""
        return None if self.credential is None else self.credential.to_value()

    def set_credential(self, credential: SignedCredential) -> None:
        """This node's fresh credential (admitted, or refreshed): present it from now on."""
        self._credential_metrics(credential)
        self.credential = credential
        if self.security is not None:
            self.security.credential_changed()
        if self.dht.table is not None:  # a member already: its claim carries the new one
            self.dht.credential_changed()

    def _credential_metrics(self, credential: SignedCredential) -> None:
        """Export when ``credential`` expires. Declared with the first credential: a node that
        holds none (an open run's, one still queued) exports no expiry rather than a 0 that
        reads as expired in 1970."""
        expiry = self.metrics.gauge(
            "agora_credential_expiry_timestamp_seconds", "When this node's credential expires (Unix time)."
        )
        expiry.set(credential.credential.expires)
        left = self.metrics.gauge(
            "agora_credential_remaining_seconds", "Seconds until this node's credential expires."
        )
        left.set_function(lambda: self.credential.credential.remaining_s() if self.credential else 0.0)

    def observe_revocations(self, revocations: Revocations | None) -> None:
        """A revocation list just read or published: its nodes' connections are dropped."""
        if self.security is not None:
            self.security.verifier.observe(revocations)

    def drop_link(self, seconds: float) -> None:
        """Fault injection: this node sends and receives no RPC (DHT included) for ``seconds``."""
        self.server.drop_link(seconds)
        self.client.drop_link(seconds)

    async def serve(self) -> str:
        """Bind the RPC port and serve (no DHT yet: a node of an authorized run answers the
        authorizer's dial-back before it joins); returns the bound address. Once only."""
        if self.server.address is None:
            await self.server.start()
        return self.server.address

    async def start(self) -> str:
        """Serve (unless :meth:`serve` already did), then join the run's DHT; returns the
        address others reach this node at."""
        await self.serve()
        return await self.dht.start()

    async def stop(self, *, grace_s: float = 0.0) -> None:
        """Leave the DHT, let in-flight requests finish (up to ``grace_s``), close."""
        await self.dht.stop(leave=True)
        await self.server.stop(grace_s=grace_s)
        await self.client.close()
