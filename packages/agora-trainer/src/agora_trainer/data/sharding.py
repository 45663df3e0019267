"""Any corpus into a verified shard set: dedup, a held-out split, parallel tokenizing, a manifest.

``make_shards`` reads the corpus as jobs (``agora_trainer.data.corpus``), tokenizes them in worker
processes (``agora_trainer.data.tokenize_jobs``) and, in the main process, in corpus order:

* drops a document whose text equals an earlier one's (exact duplicates, by digest);
* holds out every ``1 / validation_fraction``-th remaining document, evenly spread, for the
  validation split (a shard of its own that trainers never open; the first at position
  ``0.5 / fraction``, so even a small corpus holds one out);
* deals every other document to the training shard with the fewest tokens so far;
* stops once ``max_bytes`` of text are in, and writes ``manifest.json`` last.

Results are taken in job order, so the same corpus and seed give the same shards whatever the
number of workers. Asked for a BPE (``TrainBpe``), it first learns the tokenizer from the
first training documents (never from validation ones), then shards with it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

from agora_trainer.data.bpe import train_bpe
from agora_trainer.data.corpus import BATCH_BYTES, Job, corpus_files, corpus_jobs, default_corpus, input_bytes
from agora_trainer.data.manifest import MANIFEST, Manifest, tokenizer_entry, write_manifest
from agora_trainer.data.shards import ShardWriter
from agora_trainer.data.tokenize_jobs import JobResult, run_job, start_worker, tokenize_job
from agora_trainer.data.tokenizer import Tokenizer
from agora_trainer.errors import ShardError

PARALLELISM = "TOKENIZERS_PARALLELISM"  # the tokenizers library's switch for its own threads
# A job is one corpus batch: seconds of work even on a loaded host. Only a stuck worker
# takes this long, and then make_shards fails instead of waiting forever.
JOB_DEADLINE_S = 600.0
# progress(text bytes kept, documents kept, input bytes read, input bytes in all)
Progress = Callable[[int, int, int, int], None]


@dataclass(frozen=True)
class TrainBpe:
    """Ask ``make_shards`` for a byte-level BPE learned from the corpus itself."""

    vocab_size: int
    # Text it learns from: merges settle within a few MB (on the standard library's sources,
    # 2 MB and 8 MB give the same bytes per token within 1 %), and it takes seconds.
    train_bytes: int = 4_000_000


def is_validation(position: int, fraction: float) -> bool:
    """Whether the ``position``-th unique document is held out: exactly ``fraction`` of them,
    evenly spread, decided by position alone (both passes over the corpus agree)."""
    return fraction > 0 and math.floor((position + 1) * fraction + 0.5) > math.floor(
        position * fraction + 0.5
    )


def make_shards(
    out_dir: str | Path,
    *,
    shards: int,
    tokenizer: Tokenizer | TrainBpe,
    sources: Iterable[Path] | None = None,
    seed: int = 0,
    max_bytes: int | None = None,
    validation_fraction: float = 0.01,
    text_field: str = "text",
    workers: int | None = None,
    progress: Progress | None = None,
) -> Manifest:
    """Tokenize the corpus in ``sources`` (default: the standard library's sources) into
    ``shards`` training shards and a validation shard in ``out_dir``; returns the manifest.
    ``workers``: tokenizing processes (default: one per CPU for a corpus of several MB)."""
    if shards < 1:
        raise ShardError("shards must be >= 1")
    if not 0 <= validation_fraction <= 0.5:
        raise ShardError(f"validation_fraction must lie in [0, 0.5], got {validation_fraction}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source_list = [Path(s) for s in sources] if sources is not None else [default_corpus()]
    files = corpus_files(source_list)
    total_input = input_bytes(files)
    expected = min(total_input, max_bytes) if max_bytes else total_input
    if workers is None:  # a spawned worker costs a fraction of a second: only worth it for MBs
        workers = (os.cpu_count() or 1) if expected > 4 * BATCH_BYTES else 1
    # An interrupted run must not leave an old manifest over new files: no manifest, no shard set.
    (out / MANIFEST).unlink(missing_ok=True)

    def jobs() -> Iterator[Job]:
        return corpus_jobs(files, text_field=text_field, seed=seed)

    if isinstance(tokenizer, TrainBpe):
        tokenizer, origin = _learn_bpe(tokenizer, jobs(), validation_fraction, max_bytes)
    else:
        origin = getattr(tokenizer, "origin", tokenizer.kind)  # a tokenizer.json: its path
    entry = tokenizer_entry(tokenizer, out, origin=origin)
    counts = dict.fromkeys(("read", "duplicates", "skipped", "train", "validation"), 0)
    # The workers start before any shard file is open: a forked child must not inherit one.
    with _tokenized(jobs(), tokenizer, workers) as results:
        writers = [
            ShardWriter(
                out, i, f"shard-{i:05d}", "train", vocab_size=entry.vocab_size, separator=entry.separator
            )
            for i in range(shards)
        ]
        held_out = ShardWriter(
            out,
            shards,
            "validation-00000",
            "validation",
            vocab_size=entry.vocab_size,
            separator=entry.separator,
        )
        seen: set[bytes] = set()
        kept_bytes = read_bytes = 0
        if progress is not None:
            progress(0, 0, 0, total_input)  # tokenizing starts
        for result in results:
            counts["skipped"] += result.skipped
            read_bytes += result.input_bytes
            for doc in result.documents:
                counts["read"] += 1
                if doc.digest in seen:
                    counts["duplicates"] += 1
                    continue
                position = len(seen)
                seen.add(doc.digest)
                if is_validation(position, validation_fraction):
                    held_out.add(doc.ids, doc.text_bytes)
                    counts["validation"] += 1
                else:
                    min(writers, key=lambda w: w.tokens).add(doc.ids, doc.text_bytes)
                    counts["train"] += 1
                kept_bytes += doc.text_bytes
                if max_bytes is not None and kept_bytes >= max_bytes:
                    break
            if progress is not None:
                progress(kept_bytes, len(seen), read_bytes, total_input)
            if max_bytes is not None and kept_bytes >= max_bytes:
                break  # leaving the block stops the workers
    entries = [w.close() for w in writers]
    if held_out.documents:
        entries.append(held_out.close())
    else:
        held_out.abandon()
    _remove_stale(out, {f"{e.name}.tokens" for e in entries})
    manifest = Manifest(
        tokenizer=entry,
        dtype=writers[0].dtype.name,
        shards=tuple(entries),
        seed=seed,
        source=tuple(map(str, source_list)),
        validation_fraction=validation_fraction,
        documents=counts,
    )
    write_manifest(out, manifest)
    return manifest


def _learn_bpe(
    request: TrainBpe, jobs: Iterator[Job], fraction: float, max_bytes: int | None
) -> tuple[Tokenizer, str]:
    """A BPE learned from the first unique training documents, up to ``train_bytes``."""
    cap = min(request.train_bytes, max_bytes) if max_bytes else request.train_bytes
    used = {"bytes": 0, "documents": 0}

    def training_texts() -> Iterator[str]:
        seen: set[bytes] = set()
        for job in jobs:  # reading a few MB: in this process, no workers to start
            for doc in run_job(job, None, keep_text=True).documents:
                if doc.digest in seen:
                    continue
                seen.add(doc.digest)
                if is_validation(len(seen) - 1, fraction):
                    continue
                used["bytes"] += doc.text_bytes
                used["documents"] += 1
                yield doc.text
                if used["bytes"] >= cap:
                    return

    tokenizer = train_bpe(training_texts(), request.vocab_size)
    origin = (
        f"bpe-{request.vocab_size} trained on {used['bytes'] / 1e6:.1f} MB "
        f"({used['documents']} training documents)"
    )
    return tokenizer, origin


@contextlib.contextmanager
def _tokenized(jobs: Iterator[Job], tokenizer: Tokenizer, workers: int) -> Iterator[Iterator[JobResult]]:
    """Each job's result, in job order. ``workers`` processes work ahead, at most two jobs
    each, so memory stays bounded however large the corpus; one worker: this process."""
    if workers <= 1:
        yield (run_job(job, tokenizer, keep_text=False) for job in jobs)
        return
    with _worker_pool(workers, (tokenizer.to_json(), tokenizer.kind, tokenizer.vocab_size)) as pool:

        def results() -> Iterator[JobResult]:
            pending: deque[concurrent.futures.Future] = deque()
            with _worker_failures():
                for job in jobs:
                    pending.append(pool.submit(tokenize_job, job))
                    if len(pending) >= 2 * workers:
                        yield pending.popleft().result(timeout=JOB_DEADLINE_S)
                while pending:
                    yield pending.popleft().result(timeout=JOB_DEADLINE_S)

        yield results()


@contextlib.contextmanager
def _worker_failures() -> Iterator[None]:
    """A worker that died or got stuck fails make_shards with a ShardError: never a hang."""
    try:
        yield
    except BrokenProcessPool as e:
        raise ShardError(
            "a tokenizing worker process died (killed by a signal, or out of memory); "
            "no shard set was written: run again, or with fewer workers"
        ) from e
    except concurrent.futures.TimeoutError as e:
        raise ShardError(
            f"a tokenizing worker returned nothing in {JOB_DEADLINE_S:g} s; no shard set was written"
        ) from e


@contextlib.contextmanager
def _worker_pool(workers: int, args: tuple) -> Iterator[concurrent.futures.ProcessPoolExecutor]:
    """Forked workers where the platform forks: they start in milliseconds and need no
    importable ``__main__`` (spawned ones re-import the caller's script). A forked child of a
    process whose tokenizers thread pool ran (learning a BPE does) runs single-threaded; saying
    so in the environment first keeps the library from warning about it in every child.

    A process pool executor, not ``multiprocessing.Pool``: when a worker dies (a signal, the
    out-of-memory killer), its jobs fail at once instead of never returning."""
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context(method), initializer=start_worker, initargs=args
    )
    try:
        # the workers start (fork) now, before any shard file is open: a child must not inherit one
        before = os.environ.get(PARALLELISM)
        os.environ[PARALLELISM] = "false"
        try:
            with _worker_failures():
                pool.submit(os.getpid).result(timeout=JOB_DEADLINE_S)
        finally:
            if before is None:
                del os.environ[PARALLELISM]
            else:
                os.environ[PARALLELISM] = before
        yield pool
    except BaseException:
        _kill_workers(pool)  # a stuck worker would hold the shutdown below forever
        raise
    finally:  # also when the caller stops reading early: the queued jobs are dropped
        pool.shutdown(wait=True, cancel_futures=True)


def _kill_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """SIGKILL the pool's processes: the executor sees them die and stops its own thread
    (Python before 3.14 has no public call that stops a pool's processes)."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
        process.join(timeout=10)


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Shard files of an earlier shard set in ``out`` that this one does not list."""
    for pattern in ("shard-*.tokens", "validation-*.tokens", "shard-*.json"):  # *.json: the v1 format's
        for path in out.glob(pattern):
            if path.name not in keep:
                path.unlink()
