"""A DHT node for callers outside asyncio: the node runs on its own event-loop thread.

Every method submits a coroutine to that loop and waits for it with a deadline, so the node's
sockets stay on one thread however many threads call in.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from agora_core.dht.membership import Member
from agora_core.dht.node import DhtNode
from agora_core.dht.values import DhtValue
from agora_core.identity import NodeKey


class BlockingDht:
    def __init__(self, *, timeout_s: float = 30.0, run_node: dict | None = None, **node_kwargs: Any):
        """``node_kwargs`` are DhtNode's, or ``run_node`` RunNode's (a member of a run, with
        its transport security in an authorized one); ``timeout_s`` bounds every call."""
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="agora-dht", daemon=True)
        self._thread.start()
        self._run_node = None
        if run_node is not None:
            self._run_node = self._run(self._make_run_node(run_node))
            self.node: DhtNode = self._run_node.dht
        else:
            self.node = self._run(self._make(node_kwargs))

    @staticmethod
    async def _make(node_kwargs: dict) -> DhtNode:
        return DhtNode(**node_kwargs)  # created on the loop that will own its sockets

    @staticmethod
    async def _make_run_node(kwargs: dict):
        from agora_core.node.run_node import RunNode  # it builds on the DHT: imported when used

        return RunNode(**kwargs)

    def _run(self, coro, timeout_s: float | None = None):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout_s if timeout_s is None else timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coro, timeout_s: float | None = None):
        """Run ``coro`` on the node's loop (say, a call through ``self.client``) and wait."""
        return self._run(coro, timeout_s)

    @property
    def client(self):
        """The node's RPC client (authenticated as the node in an authorized run)."""
        return self.node.client

    @property
    def address(self) -> str | None:
        return self.node.address

    def start(self) -> str:
        started = self.node.start() if self._run_node is None else self._run_node.start()
        return self._run(started, self.node.config.join_timeout_s + self.timeout_s)

    def stop(self, *, leave: bool = True) -> None:
        if not self._loop.is_running():
            return
        try:
            self._run(self.node.stop(leave=leave) if self._run_node is None else self._run_node.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=self.timeout_s)
            self._loop.close()

    def __enter__(self) -> BlockingDht:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def store(
        self, key: str, subkey: str, value: Any, expiration: float, *, signer: NodeKey | None = None
    ) -> int:
        return self._run(self.node.store(key, subkey, value, expiration, signer=signer))

    def get(self, key: str) -> dict[str, DhtValue]:
        return self._run(self.node.get(key))

    def get_many(self, keys: Sequence[str]) -> dict[str, dict[str, DhtValue]]:
        return self._run(self.node.get_many(keys))

    def delete(self, key: str, subkey: str, *, signer: NodeKey | None = None) -> int:
        return self._run(self.node.delete(key, subkey, signer=signer))

    def members(self) -> list[Member]:
        async def read() -> list[Member]:
            return self.node.members()

        return self._run(read())
