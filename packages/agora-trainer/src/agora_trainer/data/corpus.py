"""Where training text comes from: folders of text files, JSON lines, Parquet.

A source is a file or a folder (searched recursively). By name: ``.jsonl`` and ``.jsonl.gz``
hold one JSON object per line whose ``text_field`` is a document; ``.parquet`` (with the
optional ``pyarrow``: ``pip install agora-trainer[parquet]``) holds a column of them; any
other file given by name, and ``.py .txt .md .rst`` files found in folders, is one document.
Text files are shuffled by ``seed`` (a folder's files come in no meaningful order); records
keep their order.

The corpus is read as a sequence of ``Job``s, batches of about ``batch_bytes`` of raw input,
each turned into documents by ``agora_trainer.data.tokenize_jobs`` in a worker process: this module
only reads bytes, so the main process stays free to write shards.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from agora_core import world
from agora_trainer.errors import CorpusError

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")  # picked up from folders
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
PARQUET_SUFFIX = ".parquet"
RECORD_SUFFIXES = (*JSONL_SUFFIXES, PARQUET_SUFFIX)  # files of many documents each
SKIPPED_FOLDERS = {"__pycache__", "site-packages", ".git"}
BATCH_BYTES = 1 << 20  # raw input per job: large enough to amortize a worker's round trip


@dataclass(frozen=True)
class Job:
    """A batch of raw input for one worker: text file paths, JSON lines, or texts."""

    kind: str  # "files", "lines" or "texts"
    source: str  # the file the items come from ("files": several; named per item)
    items: list = field(default_factory=list)  # paths (str), raw lines (bytes) or texts (str)
    first_line: int = 1  # "lines": the line number of items[0], for error messages
    text_field: str = "text"
    input_bytes: int = 0  # bytes of the source files this job stands for (progress)


def default_corpus() -> Path:
    """The Python standard library's own sources: real text present on every machine."""
    return Path(sysconfig.get_paths()["stdlib"])


def _is(path: Path, suffixes: tuple[str, ...]) -> bool:
    return path.name.endswith(suffixes)


def corpus_files(sources: Iterable[Path]) -> list[Path]:
    """Every file the sources stand for, in a stable order; CorpusError for a missing one."""
    files: list[Path] = []
    wanted = TEXT_SUFFIXES + RECORD_SUFFIXES
    for source in sources:
        source = Path(source)
        if source.is_file():
            files.append(source)
        elif source.is_dir():
            found = []
            for folder, subfolders, names in os.walk(source):
                # compiled files and the stdlib folder's installed packages are not its sources
                subfolders[:] = [d for d in subfolders if d not in SKIPPED_FOLDERS]
                found.extend(Path(folder, name) for name in names if name.endswith(wanted))
            files.extend(sorted(found))
        else:
            raise CorpusError(f"source {source} does not exist")
    return files


def corpus_jobs(
    files: list[Path], *, text_field: str = "text", seed: int = 0, batch_bytes: int = BATCH_BYTES
) -> Iterator[Job]:
    """The corpus's files (``corpus_files``) as jobs: the text files shuffled by ``seed``
    first, then each record file in order."""
    texts = [p for p in files if not _is(p, RECORD_SUFFIXES)]
    world.rng(seed).shuffle(texts)
    yield from _file_jobs(texts, batch_bytes)
    for path in files:
        if _is(path, JSONL_SUFFIXES):
            yield from _jsonl_jobs(path, text_field, batch_bytes)
        elif _is(path, (PARQUET_SUFFIX,)):
            yield from _parquet_jobs(path, text_field, batch_bytes)


def _file_jobs(paths: list[Path], batch_bytes: int) -> Iterator[Job]:
    batch: list[str] = []
    size = 0
    for path in paths:
        with contextlib.suppress(OSError):  # vanished: the worker skips it like any unreadable file
            size += path.stat().st_size
        batch.append(str(path))
        if size >= batch_bytes:
            yield Job("files", "text files", batch, input_bytes=size)
            batch, size = [], 0
    if batch:
        yield Job("files", "text files", batch, input_bytes=size)


def _jsonl_jobs(path: Path, text_field: str, batch_bytes: int) -> Iterator[Job]:
    try:
        raw = open(path, "rb")
    except OSError as exc:
        raise CorpusError(f"cannot read {path}: {exc}") from None
    with raw:
        stream = gzip.open(raw) if path.name.endswith(".gz") else raw
        lines: list[bytes] = []
        first, size, read_at = 1, 0, 0
        try:
            for number, line in enumerate(stream, start=1):
                if not lines:
                    first = number
                lines.append(line)
                size += len(line)
                if size >= batch_bytes:
                    position = raw.tell()  # compressed bytes consumed, for a .gz
                    yield Job("lines", str(path), lines, first, text_field, position - read_at)
                    lines, size, read_at = [], 0, position
        except (OSError, EOFError) as exc:  # a truncated or corrupt .gz
            raise CorpusError(f"{path}: cannot read past line {first + len(lines)}: {exc}") from None
        if lines:
            yield Job("lines", str(path), lines, first, text_field, raw.tell() - read_at)


def _parquet_jobs(path: Path, text_field: str, batch_bytes: int) -> Iterator[Job]:
    try:
        import pyarrow.parquet as pq  # optional: agora-trainer[parquet]
    except ImportError:
        raise CorpusError(
            f"{path}: reading .parquet needs pyarrow (pip install agora-trainer[parquet])"
        ) from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors have no common base worth naming
        raise CorpusError(f"cannot read {path} as Parquet: {exc}") from None
    if text_field not in parquet.schema_arrow.names:
        raise CorpusError(
            f"{path} has no column {text_field!r} (columns: {', '.join(parquet.schema_arrow.names)})"
        )
    rows = max(1, parquet.metadata.num_rows)
    per_row = path.stat().st_size / rows
    texts: list[str] = []
    size = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        column = batch.column(0).to_pylist()
        texts.extend(column)  # nulls and non-strings included: the worker counts them as skipped
        size += sum(len(t) for t in column if isinstance(t, str))
        if size >= batch_bytes:
            yield Job("texts", str(path), texts, text_field=text_field, input_bytes=int(len(texts) * per_row))
            texts, size = [], 0
    if texts:
        yield Job("texts", str(path), texts, text_field=text_field, input_bytes=int(len(texts) * per_row))


def input_bytes(files: Iterable[Path]) -> int:
    """Bytes on disk of the corpus's files: what progress is measured against."""
    total = 0
    for path in files:
        with contextlib.suppress(OSError):
            total += path.stat().st_size
    return total
