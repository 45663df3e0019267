"""Asyncio RPC over ZeroMQ: unary calls, flow-controlled streams, typed errors."""

from agora_core.rpc.client import RpcClient
from agora_core.rpc.server import RpcServer
from agora_core.rpc.streams import ClientStream, ServerStream, StreamChannel
from agora_core.rpc.tensor_stream import TensorAssembler, receive_tensor, send_tensor
from agora_core.rpc.types import Payload, Request, RpcConfig, Traffic

__all__ = [
    "ClientStream",
    "Payload",
    "Request",
    "RpcClient",
    "RpcConfig",
    "RpcServer",
    "ServerStream",
    "StreamChannel",
    "TensorAssembler",
    "Traffic",
    "receive_tensor",
    "send_tensor",
]
