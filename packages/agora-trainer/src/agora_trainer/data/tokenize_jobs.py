"""What a shard-making worker process does with a ``corpus.Job``: documents, digests, token ids.

Each worker process builds its tokenizer once (``start_worker``) and then turns jobs into
``Document``s: it reads the job's files or parses its JSON lines, drops empty and unreadable
documents (counted), hashes each document's text (the main process drops exact duplicates by
that digest) and tokenizes it. Parsing, hashing and tokenizing all happen here, off the main
process. The same function runs in the main process when there is one worker, or when only
texts are wanted (to train a BPE on).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agora_trainer.data.corpus import Job
from agora_trainer.data.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer
from agora_trainer.errors import CorpusError


@dataclass
class Document:
    digest: bytes  # BLAKE2b-128 of its UTF-8 text: equal texts, equal digests
    text_bytes: int
    ids: np.ndarray | None = None  # token ids; None when only the text was asked for
    text: str | None = None


@dataclass
class JobResult:
    documents: list[Document] = field(default_factory=list)
    skipped: int = 0  # unreadable, not UTF-8, empty, or a record whose field is null
    input_bytes: int = 0


_tokenizer: Tokenizer | None = None


def start_worker(tokenizer_json: str | None, kind: str, vocab_size: int) -> None:
    """A worker process's initializer: its own tokenizer, single-threaded (the processes are
    the parallelism; the library's thread pool would only compete with them)."""
    global _tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read when the library first runs in parallel
    _tokenizer = (
        ByteTokenizer()
        if tokenizer_json is None
        else JsonTokenizer(tokenizer_json, kind=kind, vocab_size=vocab_size)
    )


def tokenize_job(job: Job) -> JobResult:
    """The worker's task: ``job`` tokenized with the tokenizer ``start_worker`` built."""
    return run_job(job, _tokenizer, keep_text=False)


def run_job(job: Job, tokenizer: Tokenizer | None, *, keep_text: bool) -> JobResult:
    texts, skipped = _texts(job)
    result = JobResult(skipped=skipped, input_bytes=job.input_bytes)
    encoded = [text.encode("utf-8") for text in texts]
    if tokenizer is None:
        ids: list[np.ndarray | None] = [None] * len(texts)
    elif isinstance(tokenizer, JsonTokenizer):
        ids = list(tokenizer.encode_batch(texts))
    else:
        ids = [tokenizer.encode(text) for text in texts]
    for text, data, token_ids in zip(texts, encoded, ids, strict=True):
        result.documents.append(
            Document(
                digest=hashlib.blake2b(data, digest_size=16).digest(),
                text_bytes=len(data),
                ids=token_ids,
                text=text if keep_text else None,
            )
        )
    return result


def _texts(job: Job) -> tuple[list[str], int]:
    """The job's non-empty documents and how many were skipped."""
    texts: list[str] = []
    skipped = 0
    if job.kind == "files":
        for name in job.items:
            try:
                text = Path(name).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                skipped += 1  # a binary or unreadable file among text files: not a document
                continue
            texts.append(text)
    elif job.kind == "lines":
        for number, line in enumerate(job.items, start=job.first_line):
            if not line.strip():
                continue
            texts.append(_record_text(line, job, number))
    elif job.kind == "texts":
        texts = [t for t in job.items if isinstance(t, str)]
        skipped = len(job.items) - len(texts)
    else:
        raise CorpusError(f"unknown job kind {job.kind!r}")
    kept = [t for t in texts if t]
    return kept, skipped + len(texts) - len(kept)


def _record_text(line: bytes, job: Job, number: int) -> str:
    where = f"{job.source}:{number}"
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise CorpusError(f"{where}: not a JSON object ({exc})") from None
    if not isinstance(record, dict) or job.text_field not in record:
        keys = ", ".join(map(repr, list(record)[:8])) if isinstance(record, dict) else type(record).__name__
        raise CorpusError(
            f"{where}: no {job.text_field!r} field (it has {keys}; choose one with --text-field)"
        )
    text = record[job.text_field]
    if text is None:
        return ""  # a null document: skipped like an empty one
    if not isinstance(text, str):
        raise CorpusError(f"{where}: field {job.text_field!r} holds a {type(text).__name__}, not text")
    return text
