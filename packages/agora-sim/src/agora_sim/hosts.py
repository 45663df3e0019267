"""Simulated hosts: a machine with an address, an access link, and the tasks that run on it.

Code runs "on" a host while the host is active (:meth:`SimHost.active`): the endpoints it opens
take the host's address and link, and the tasks it creates are the host's, so killing the host
cancels them, as a process that dies takes its threads with it. A host can also fall silent
(its cable pulled: nothing in or out, no connection notices) and sit in a partition group.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from agora_sim.links import LinkModel, LinkState

if TYPE_CHECKING:
    from agora_sim.network import SimEndpoint

_current: contextvars.ContextVar[SimHost | None] = contextvars.ContextVar("agora_sim_host", default=None)


def current_host() -> SimHost | None:
    return _current.get()


def ip_of(index: int) -> str:
    """Host ``index``'s address: in 127.0.0.0/8, so nothing a simulated node dials (should one
    reach a real socket by mistake) leaves the machine."""
    if not 0 <= index < 250 * 256 * 256:
        raise ValueError(f"host index {index} is out of the simulated address space")
    return f"127.{1 + index // 65536}.{index // 256 % 256}.{index % 256}"


class SimHost:
    def __init__(self, index: int, name: str, link: LinkModel):
        self.index = index
        self.name = name
        self.ip = ip_of(index)
        self.link = LinkState(link)
        self.alive = True
        self.silent_until = 0.0  # loop time
        self.group: int | None = None  # partition group; None: reaches every host
        self.skew_s = 0.0  # how far this host's wall clock is off (world.wall() on it)
        # Insertion-ordered (a dict, not a set): a kill closes and cancels in the order things
        # were made, never in the order of their memory addresses, which differ run to run.
        self.endpoints: dict[SimEndpoint, None] = {}
        self.tasks: weakref.WeakKeyDictionary[asyncio.Task, None] = weakref.WeakKeyDictionary()
        self._next_port = 7000

    def __repr__(self) -> str:
        return f"SimHost({self.index}, {self.name!r}, {self.ip})"

    @contextlib.contextmanager
    def active(self) -> Iterator[SimHost]:
        """Run the body on this host (and every task it creates, and theirs)."""
        if not self.alive:
            raise RuntimeError(f"host {self.name} was killed")
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def port(self) -> int:
        self._next_port += 1
        return self._next_port

    def silent(self, now: float) -> bool:
        return now < self.silent_until


def track_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Make every task created on ``loop`` belong to the host active where it was created."""

    def factory(loop, coro, **kwargs):
        task = asyncio.Task(coro, loop=loop, **kwargs)
        host = _current.get()
        if host is not None:
            host.tasks[task] = None
        return task

    loop.set_task_factory(factory)
