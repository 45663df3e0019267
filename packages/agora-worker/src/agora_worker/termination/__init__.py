"""Self-termination (report 3.3.1.6): rules over the worker's own signals, and the watchdog task
that evaluates them and makes the worker depart when one trips."""

from agora_worker.termination.rules import EXIT_CODES, Verdict, round_failed
from agora_worker.termination.watchdog import Watchdog, watchdog_for

__all__ = ["EXIT_CODES", "Verdict", "Watchdog", "round_failed", "watchdog_for"]
