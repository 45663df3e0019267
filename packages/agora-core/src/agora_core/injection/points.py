"""The hook interface: the points in a node's code where armed injections fire.

Each role passes one :class:`InjectionPoints` to the components whose code paths a trigger
names (the averaging sender's chunk loop, the pipeline handlers, the state download, the
trainer's hops). They call it like this, so a node with nothing armed pays one attribute
load and a truth test (an empty frozenset) per pass::

    if points.armed:
        points.reached(Trigger.FORWARD)

``reached`` runs the due injections' actions right there, synchronously, on the caller's
thread: an exit happens mid-forward, a hang blocks the very handler (and the event loop), a
NaN corrupts the reply being built. Only the event loop's thread calls it.
"""

from __future__ import annotations

from collections.abc import Callable

from agora_core.injection.record import Injection, Trigger

# Triggers that wait for a count of chunks (or pieces) first: ``at_chunk`` of them.
COUNTED = (Trigger.AVERAGING_SEND, Trigger.DOWNLOAD)


class InjectionPoints:
    def __init__(self) -> None:
        self.armed: frozenset[Trigger] = frozenset()  # triggers with an injection waiting
        self._waiting: dict[Trigger, list[Injection]] = {}
        # Set by the node's watcher: obey(injection, where) logs, counts and acts.
        self.obey: Callable[[Injection, str], None] = lambda injection, where: None

    def arm(self, injection: Injection) -> None:
        self._waiting.setdefault(injection.trigger, []).append(injection)
        self._update()

    def waiting(self) -> list[Injection]:
        return [injection for waiting in self._waiting.values() for injection in waiting]

    def expire(self, now: float) -> list[Injection]:
        """Disarm and return the injections whose record expired before the code got there."""
        gone = [injection for injection in self.waiting() if injection.expires <= now]
        for injection in gone:
            self._waiting[injection.trigger].remove(injection)
        self._update()
        return gone

    def reached(self, trigger: Trigger, *, index: int = 0, count: int = 1) -> None:
        """The code is at ``trigger``'s point; for a counted trigger, about to do chunk (or
        piece) ``index`` of ``count``. An injection waiting for chunk n fires at chunk
        min(n, count - 1): a slice shorter than n chunks still gets it, at its last chunk."""
        waiting = self._waiting.get(trigger)
        if not waiting:
            return
        due = [i for i in waiting if trigger not in COUNTED or index >= min(i.at_chunk, count - 1)]
        for injection in due:
            waiting.remove(injection)
        self._update()
        for injection in due:
            self.obey(injection, trigger.value)

    def _update(self) -> None:
        self.armed = frozenset(trigger for trigger, waiting in self._waiting.items() if waiting)


NO_INJECTIONS = InjectionPoints()  # the default of components built without a node (tests, tools)
