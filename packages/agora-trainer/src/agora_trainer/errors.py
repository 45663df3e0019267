"""The data pipeline's typed errors: each names the file, shard or line it is about."""

from __future__ import annotations

from agora_core.errors import AgoraError


class DataError(AgoraError):
    """Training data that cannot be made, opened or used as asked."""


class CorpusError(DataError):
    """A source of text that cannot be read (a missing file, a jsonl line without the field)."""


class TokenizerError(DataError):
    """A tokenizer that is missing, unreadable, or not the one the run or the shards use."""


class ShardError(DataError):
    """A shard set or a shard that is missing, malformed, or does not fit the run."""


class ShardCorrupt(ShardError):
    """A shard whose bytes differ from its manifest's digest or size."""
