"""Data shards: packed token ids on disk, memory-mapped, verified against their manifest.

A shard's ``<name>.tokens`` holds token ids back to back (little-endian, the smallest
unsigned dtype the vocabulary fits); ``manifest.json`` beside it (``agora_trainer.data.manifest``)
says which tokenizer made them, and each shard's split, counts and BLAKE2b digest. Opening a
shard set checks every shard it opens against its size and digest, so a shard that was
altered, truncated or swapped is refused, by name, before any of it is trained on.

Documents are separated by the tokenizer's separator id. A sample is ``seq_len + 1``
consecutive tokens (inputs and next-token labels); sample i starts at token ``i * seq_len``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agora_trainer.data.manifest import Manifest, ShardEntry, TokenizerEntry, read_manifest
from agora_trainer.errors import ShardCorrupt, ShardError

__all__ = [
    "SEPARATOR",
    "Shard",
    "ShardCorrupt",
    "ShardError",
    "ShardSet",
    "ShardWriter",
    "open_shard_set",
    "open_shards",
]

SEPARATOR = 0  # the separator of the two tokenizers made here: NUL for bytes, <|endoftext|> for BPE


def token_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ShardError(f"vocabulary of {vocab_size} does not fit uint32")


@dataclass(frozen=True)
class Shard:
    """An opened, verified shard."""

    entry: ShardEntry
    path: Path
    tokens: np.ndarray  # over a read-only memory map of the file

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def documents(self) -> int:
        return self.entry.documents

    def sample_count(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens ``[index * seq_len, index * seq_len + seq_len]`` (inclusive): seq_len + 1 ids."""
        start = index * seq_len
        return np.asarray(self.tokens[start : start + seq_len + 1])


@dataclass(frozen=True)
class ShardSet:
    directory: Path
    manifest: Manifest
    shards: list[Shard]  # of one split, in manifest order

    @property
    def tokenizer(self) -> TokenizerEntry:
        return self.manifest.tokenizer

    @property
    def identity(self) -> str:
        """A short digest of its shards' ids and digests: the same set, wherever it lies."""
        text = ",".join(f"{s.entry.id}:{s.entry.blake2b}" for s in self.shards)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=32)).hexdigest()


def open_shard(directory: Path, entry: ShardEntry, dtype: np.dtype, *, verify: bool = True) -> Shard:
    path = directory / f"{entry.name}.tokens"
    expected = entry.tokens * dtype.itemsize
    actual = path.stat().st_size if path.exists() else -1
    if actual < 0:
        raise ShardError(f"shard {entry.name} ({path}) is missing")
    if actual != expected:
        raise ShardCorrupt(f"shard {entry.name} ({path}) holds {actual} bytes; its manifest says {expected}")
    if verify and file_digest(path) != entry.blake2b:
        raise ShardCorrupt(
            f"shard {entry.name} ({path}) was altered: its BLAKE2b digest is not the manifest's; "
            "remake the shard set (tools/make_shards.py)"
        )
    # A plain ndarray over the mapping: slicing a np.memmap costs 4 us a sample, this 1 us.
    tokens = (
        np.asarray(np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(entry.tokens,)))
        if entry.tokens
        else np.zeros(0, dtype)
    )
    return Shard(entry, path, tokens)


def open_shard_set(directory: str | Path, split: str = "train", *, verify: bool = True) -> ShardSet:
    """The shards of ``split`` in ``directory``, each checked against the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    entries = manifest.split(split)
    if not entries:
        raise ShardError(
            f"{directory} has no {split} shards"
            + (" (remake it with --validation-fraction above 0)" if split == "validation" else "")
        )
    try:
        dtype = np.dtype(manifest.dtype)
    except TypeError:
        raise ShardError(f"{directory}: manifest dtype {manifest.dtype!r} is not a numpy dtype") from None
    return ShardSet(directory, manifest, [open_shard(directory, e, dtype, verify=verify) for e in entries])


def open_shards(directory: str | Path, split: str = "train") -> list[Shard]:
    """Every shard of ``split`` in ``directory``, in manifest order, verified."""
    return open_shard_set(directory, split).shards


class ShardWriter:
    """Appends documents to one shard; ``close()`` moves it into place and returns its entry.
    The digest is computed as it is written: no second pass over the file."""

    def __init__(
        self, directory: Path, shard_id: int, name: str, split: str, *, vocab_size: int, separator: int
    ):
        self.directory = directory
        self.id, self.name, self.split = shard_id, name, split
        self.dtype = token_dtype(vocab_size).newbyteorder("<")
        self._separator = np.array([separator], dtype=self.dtype).tobytes()
        self._tmp = directory / f".{name}.tokens.partial"
        self._file = open(self._tmp, "wb")
        self._hash = hashlib.blake2b(digest_size=32)
        self.tokens = 0
        self.documents = 0
        self.text_bytes = 0

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._hash.update(data)

    def add(self, ids: np.ndarray, text_bytes: int) -> None:
        if self.documents:
            self._write(self._separator)
            self.tokens += 1
        self._write(np.asarray(ids).astype(self.dtype, copy=False).tobytes())
        self.tokens += len(ids)
        self.documents += 1
        self.text_bytes += text_bytes

    def close(self) -> ShardEntry:
        self._file.close()
        os.replace(self._tmp, self.directory / f"{self.name}.tokens")
        return ShardEntry(
            id=self.id,
            name=self.name,
            split=self.split,
            tokens=self.tokens,
            documents=self.documents,
            text_bytes=self.text_bytes,
            blake2b=self._hash.hexdigest(),
        )

    def abandon(self) -> None:
        self._file.close()
        self._tmp.unlink(missing_ok=True)
