"""Data shards: packed token ids on disk, memory-mapped, with a small metadata file.

A shard is two files: ``<name>.tokens`` holds the token ids back to back (little-endian,
the smallest unsigned dtype the vocabulary fits), and ``<name>.json`` says how to read them:

    {"format": "agora-shard-v1", "tokenizer": "bytes", "vocab_size": 256, "dtype": "uint8",
     "tokens": 1048576, "documents": 812, "source": "..."}

Documents are separated by token 0. A sample is ``seq_len + 1`` consecutive tokens (inputs
and next-token labels); sample i starts at token ``i * seq_len``.
"""

from __future__ import annotations

import json
import os
import random
import sysconfig
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agora_trainer.tokenizer import Tokenizer

FORMAT = "agora-shard-v1"
SEPARATOR = 0  # between documents (NUL never occurs in text)


class ShardError(Exception):
    """A shard is missing, malformed, or does not fit the run."""


def token_dtype(vocab_size: int) -> np.dtype:
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ShardError(f"vocabulary of {vocab_size} does not fit uint32")


@dataclass(frozen=True)
class Shard:
    """An opened, checked shard."""

    name: str
    path: Path
    tokenizer: str
    vocab_size: int
    tokens: np.ndarray  # memory-mapped, read-only
    documents: int
    source: str

    def sample_count(self, seq_len: int) -> int:
        return max(0, (len(self.tokens) - 1) // seq_len)

    def sample(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens ``[index * seq_len, index * seq_len + seq_len]`` (inclusive): seq_len + 1 ids."""
        start = index * seq_len
        return np.asarray(self.tokens[start : start + seq_len + 1])


def open_shard(meta_path: Path) -> Shard:
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"cannot read shard metadata {meta_path}: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ShardError(f"{meta_path} is not an {FORMAT} shard")
    try:
        dtype = np.dtype(meta["dtype"])
        count = int(meta["tokens"])
        vocab = int(meta["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"{meta_path}: bad metadata ({exc})") from None
    data_path = meta_path.with_suffix(".tokens")
    expected = count * dtype.itemsize
    actual = data_path.stat().st_size if data_path.exists() else -1
    if actual != expected:
        raise ShardError(f"{data_path} holds {actual} bytes; its metadata says {expected}")
    tokens = (
        np.memmap(data_path, dtype=dtype.newbyteorder("<"), mode="r", shape=(count,))
        if count
        else np.zeros(0, dtype)
    )
    return Shard(
        meta_path.stem,
        data_path,
        str(meta.get("tokenizer")),
        vocab,
        tokens,
        int(meta.get("documents", 0)),
        str(meta.get("source", "")),
    )


def open_shards(directory: str | Path) -> list[Shard]:
    """Every shard in ``directory``, in name order."""
    directory = Path(directory)
    # A shard is a .json next to a .tokens file; other files (a trainer's state) are not shards.
    metas = sorted(m for m in directory.glob("*.json") if m.with_suffix(".tokens").exists())
    shards = [open_shard(m) for m in metas]
    if not shards:
        raise ShardError(f"no shards in {directory} (make some: python tools/make_shards.py {directory})")
    return shards


class ShardWriter:
    """Appends documents to one shard; ``close()`` writes the metadata last, atomically."""

    def __init__(self, directory: Path, name: str, tokenizer: Tokenizer, source: str):
        self.directory = directory
        self.name = name
        self.tokenizer = tokenizer
        self.source = source
        self.dtype = token_dtype(tokenizer.vocab_size)
        self._tmp = directory / f".{name}.tokens.partial"
        self._file = open(self._tmp, "wb")
        self.tokens = 0
        self.documents = 0

    def add(self, ids: np.ndarray) -> None:
        if self.documents:
            self._file.write(np.array([SEPARATOR], dtype=self.dtype).tobytes())
            self.tokens += 1
        self._file.write(np.asarray(ids, dtype=self.dtype.newbyteorder("<")).tobytes())
        self.tokens += len(ids)
        self.documents += 1

    def close(self) -> Path:
        self._file.close()
        os.replace(self._tmp, self.directory / f"{self.name}.tokens")
        meta = {
            "format": FORMAT,
            "tokenizer": self.tokenizer.name,
            "vocab_size": self.tokenizer.vocab_size,
            "dtype": self.dtype.name,
            "tokens": self.tokens,
            "documents": self.documents,
            "source": self.source,
        }
        meta_path = self.directory / f"{self.name}.json"
        tmp_meta = self.directory / f".{self.name}.json.partial"
        tmp_meta.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp_meta, meta_path)
        return meta_path


def default_corpus() -> Path:
    """The Python standard library's own sources: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def text_files(
    sources: Iterable[Path], suffixes: tuple[str, ...] = (".py", ".txt", ".md", ".rst")
) -> list[Path]:
    files: list[Path] = []
    for source in sources:
        if source.is_file():
            files.append(source)
        elif source.is_dir():
            files.extend(
                p
                for p in sorted(source.rglob("*"))
                if p.is_file() and p.suffix in suffixes and "site-packages" not in p.parts  # stdlib only
            )
        else:
            raise ShardError(f"source {source} does not exist")
    return files


def make_shards(
    out_dir: str | Path,
    *,
    shards: int,
    tokenizer: Tokenizer,
    sources: Iterable[Path] | None = None,
    seed: int = 0,
    max_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[Path]:
    """Tokenize text files into ``shards`` shards of about equal size; returns metadata paths.

    Files are shuffled with ``seed`` and dealt to the currently smallest shard; ``max_bytes``
    stops after that much text. Unreadable and non-UTF-8 files are skipped.
    """
    if shards < 1:
        raise ShardError("shards must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source_list = list(sources) if sources is not None else [default_corpus()]
    files = text_files(source_list)
    random.Random(seed).shuffle(files)
    writers = [
        ShardWriter(out, f"shard-{i:05d}", tokenizer, ", ".join(map(str, source_list))) for i in range(shards)
    ]
    total = 0
    for count, (text, path) in enumerate(_readable(files)):
        ids = tokenizer.encode(text)
        min(writers, key=lambda w: w.tokens).add(ids)
        total += len(text)
        if progress and count % 500 == 0:
            progress(f"{count} files, {total / 1e6:.1f} MB of text, now {path}")
        if max_bytes is not None and total >= max_bytes:
            break
    return [writer.close() for writer in writers]


def _readable(files: list[Path]) -> Iterator[tuple[str, Path]]:
    for path in files:
        try:
            yield path.read_text(encoding="utf-8"), path
        except (OSError, UnicodeDecodeError):
            continue
