"""Joining a live stage: state transfer between replicas, and the sync phases that follow."""

from agora_worker.joining.donor import StateDonor
from agora_worker.joining.download import DownloadProgress, StateDownloadFailed, download_state
from agora_worker.joining.join import Joiner, JoinOutcome
from agora_worker.joining.phases import PhaseTracker
from agora_worker.joining.probation import JoinProbation

__all__ = [
    "DownloadProgress",
    "JoinOutcome",
    "JoinProbation",
    "Joiner",
    "PhaseTracker",
    "StateDonor",
    "StateDownloadFailed",
    "download_state",
]
