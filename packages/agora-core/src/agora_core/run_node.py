"""The networking every role of a run shares: one RPC port, a client, and a DHT membership.

Workers, trainers and (later) the authorizer and monitor each hold one :class:`RunNode`: their
own RPC methods and the DHT's are served on the same port, and the DHT enforces the run's
value schemas (``agora_core.schema``, and in an authorized run the revocation list's owner) on
everything it stores. The port can be bound before the DHT is joined (:meth:`RunNode.serve`):
an authorized node answers the authorizer's dial-back there while it waits to be admitted.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agora_core.codec import CompressionPolicy
from agora_core.config import RunConfig
from agora_core.config.run import TransportConfig
from agora_core.dht import DhtNode, Validators
from agora_core.identity import NodeKey
from agora_core.linkemu import LinkEmulator
from agora_core.metrics import NodeMetrics
from agora_core.rpc import RpcClient, RpcConfig, RpcServer
from agora_core.schema import register_validators
from agora_core.wire import WireConfig, WireLimits


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
    ):
        rpc = rpc_config(run.transport)
        self.server = RpcServer(listen=listen, config=rpc, link=link, metrics=metrics, node_id=key.node_id)
        self.client = RpcClient(config=rpc, link=link, metrics=metrics, node_id=key.node_id)
        validators = Validators()
        register_validators(validators, run.name, run.admission.authorizer_key_bytes)
        self.dht = DhtNode(
            key=key,
            config=run.dht,
            bootstrap=bootstrap,
            advertise=advertise,
            server=self.server,
            client=self.client,
            metrics=metrics,
            validators=validators,
        )

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
