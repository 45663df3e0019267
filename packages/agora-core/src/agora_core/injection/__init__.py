"""Failure injection through the DHT: the operator orders failures, nodes obey them.

The operator writes a signed record (:mod:`.record`) under the run's injection key; every
worker and trainer watches the key (:mod:`.watcher`), checks that an operator wrote it
(:mod:`.operators`), and when it selects the node, fires it on a timer or at a point of its
code (:mod:`.points`) with one of the actions of :mod:`.effects`. The operator's tools write,
list and clear records with :mod:`.publish`.
"""

from agora_core.injection.effects import NodeEffects, Slowdown
from agora_core.injection.operators import OperatorKeys
from agora_core.injection.points import NO_INJECTIONS, InjectionPoints
from agora_core.injection.record import (
    INJECTED_EXIT_CODE,
    Action,
    Injection,
    InjectionRejected,
    Targets,
    Trigger,
    injections_key,
)
from agora_core.injection.watcher import InjectionWatcher

__all__ = [
    "INJECTED_EXIT_CODE",
    "NO_INJECTIONS",
    "Action",
    "Injection",
    "InjectionPoints",
    "InjectionRejected",
    "InjectionWatcher",
    "NodeEffects",
    "OperatorKeys",
    "Slowdown",
    "Targets",
    "Trigger",
    "injections_key",
]
