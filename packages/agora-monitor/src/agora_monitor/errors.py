"""The monitor's typed errors: what a user got wrong, or what it cannot reach."""

from __future__ import annotations

from agora_core.errors import AgoraError
from agora_core.node.sql import DatabaseError


class MonitorDatabaseError(DatabaseError):
    """The monitor's database cannot be opened or used (a bad --db URL, a server down)."""


class BootstrapUnreachable(AgoraError):
    """The monitor could not join the run's DHT through the --bootstrap addresses."""


class CredentialMissing(AgoraError):
    """An authorized run's DHT admits no member without a credential."""
