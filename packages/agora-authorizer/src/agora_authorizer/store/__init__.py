"""The authorizer's durable store: one schema on SQLite (the default) or PostgreSQL.

:class:`Store` is the only way the authorizer reads or writes its database; the rows it
returns are frozen dataclasses (:mod:`.rows`), the tables are in :mod:`.schema`.
"""

from agora_authorizer.store.database import (
    SUPPORTED_URLS,
    AlreadyExists,
    Banned,
    NotFound,
    StoreError,
    parse_url,
)
from agora_authorizer.store.rows import (
    Account,
    AdmissionRequest,
    Ban,
    Docket,
    IssuedCredential,
    Pardon,
    RecordedAccusation,
)
from agora_authorizer.store.store import Store

__all__ = [
    "SUPPORTED_URLS",
    "Account",
    "AdmissionRequest",
    "AlreadyExists",
    "Ban",
    "Banned",
    "Docket",
    "IssuedCredential",
    "NotFound",
    "Pardon",
    "RecordedAccusation",
    "Store",
    "StoreError",
    "parse_url",
]
