"""Turn a corpus into an Agora shard set: a manifest, training shards and a validation split.

    python tools/make_shards.py OUT_DIR [--config RUN.toml | --tokenizer bpe|bytes|PATH.json]
                                [--vocab-size 512] [--shards 8] [--source PATH ...] [--text-field text]
                                [--max-mb N] [--validation-fraction 0.01] [--bpe-train-mb 4]
                                [--workers N] [--seed 0]

(``agora-trainer make-shards`` is the same command.)

Sources are text files, folders of them (.py .txt .md .rst, searched recursively), JSON lines
(.jsonl, .jsonl.gz; --text-field names the document's field) and Parquet files (with pyarrow
installed: pip install agora-trainer[parquet]). Without --source, the corpus is the Python
standard library's own sources: real text, present on every machine, nothing downloaded.

The tokenizer is the run config's [data] tokenizer with --config, else --tokenizer: "bpe"
(the default) learns a byte-level BPE of --vocab-size ids from the first --bpe-train-mb of
the corpus's training documents and stores it with the shards as tokenizer.json; "bytes" is
one token per UTF-8 byte; a path is a Hugging Face tokenizer.json, copied in. Exact duplicate
documents are dropped; --validation-fraction of the rest are held out in a validation shard
that trainers never read and tools/evaluate.py scores on.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agora_core.config import load_run_config
from agora_core.errors import AgoraError
from agora_trainer.data.corpus import default_corpus
from agora_trainer.data.progress import ProgressBar
from agora_trainer.data.sharding import TrainBpe, make_shards
from agora_trainer.data.tokenizer import ByteTokenizer, JsonTokenizer

DEFAULT_VOCAB = 512  # examples/tiny.toml's: see its [data] section for why


def tokenizer_request(args: argparse.Namespace):
    """What --config or --tokenizer asks for: a tokenizer, or a BPE to learn."""
    name, vocab = args.tokenizer, args.vocab_size
    if args.config:
        data = load_run_config(args.config).data
        name, vocab = data.tokenizer, data.vocab_size
    if name == "bytes":
        return ByteTokenizer()
    if name == "bpe":
        return TrainBpe(vocab_size=vocab or DEFAULT_VOCAB, train_bytes=int(args.bpe_train_mb * 1e6))
    return JsonTokenizer.from_file(name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the shard set into")
    parser.add_argument("--config", help="run config TOML: its [data] tokenizer and vocab_size")
    parser.add_argument("--tokenizer", default="bpe", help="bpe (default), bytes, or a tokenizer.json path")
    parser.add_argument("--vocab-size", type=int, help=f"ids of a learned BPE (default {DEFAULT_VOCAB})")
    parser.add_argument("--shards", type=int, default=8, help="training shards (default 8)")
    parser.add_argument(
        "--source",
        type=Path,
        action="append",
        help=f"file or folder (repeatable; default: {default_corpus()})",
    )
    parser.add_argument("--text-field", default="text", help="the document's field in .jsonl/.parquet")
    parser.add_argument("--max-mb", type=float, help="stop after this many MB of text")
    parser.add_argument(
        "--validation-fraction", type=float, default=0.01, help="documents held out (default 0.01)"
    )
    parser.add_argument("--bpe-train-mb", type=float, default=4.0, help="text a BPE learns from (default 4)")
    parser.add_argument("--workers", type=int, help="tokenizing processes (default: one per CPU)")
    parser.add_argument("--seed", type=int, default=0, help="text file shuffling seed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    bar = ProgressBar("tokenizing")
    last: list = []

    def progress(kept: int, documents: int, read: int, total: int, *, final: bool = False) -> None:
        if not last:  # the first call comes as tokenizing starts (after a BPE is learned)
            bar.started = time.monotonic()
        last[:] = [kept, documents, read, total]
        done, whole = (kept, args.max_mb * 1e6) if args.max_mb else (read, total)  # of text, or of the files
        rate = kept / max(time.monotonic() - bar.started, 1e-9) / 1e6
        what = f"{kept / 1e6:.1f} MB, {documents} documents, {rate:.1f} MB/s"
        (bar.finish if final else bar.update)(whole if final else done, whole, what=what)

    try:
        request = tokenizer_request(args)
        if isinstance(request, TrainBpe):
            print(f"  learning a byte-level BPE of {request.vocab_size} ids ...", flush=True)
        manifest = make_shards(
            args.out_dir,
            shards=args.shards,
            tokenizer=request,
            sources=args.source,
            seed=args.seed,
            max_bytes=int(args.max_mb * 1e6) if args.max_mb else None,
            validation_fraction=args.validation_fraction,
            text_field=args.text_field,
            workers=args.workers,
            progress=progress,
        )
    except (AgoraError, OSError) as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 2
    if last:
        progress(*last, final=True)
    train, held_out = manifest.split("train"), manifest.split("validation")
    docs = manifest.documents
    text_mb = sum(s.text_bytes for s in manifest.shards) / 1e6
    print(
        f"wrote {len(train)} training shard(s) ({sum(s.tokens for s in train) / 1e6:.2f} M tokens) and "
        f"{len(held_out)} validation shard(s) ({sum(s.tokens for s in held_out) / 1e6:.3f} M tokens, "
        f"{docs['validation']} documents) to {args.out_dir} in {time.monotonic() - started:.1f} s: "
        f"{text_mb:.1f} MB of text, {docs['duplicates']} duplicates dropped, {docs['skipped']} skipped; "
        f"tokenizer {manifest.tokenizer.describe()}"
    )
    return 0
