#!/usr/bin/env python3
"""Turn text files or folders into Agora data shards.

    python tools/make_shards.py OUT_DIR [--shards 8] [--source PATH ...] [--max-mb N] [--seed 0]

Without --source, the corpus is the Python standard library's own source files: real text,
present on every machine, no download.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from agora_trainer.shards import ShardError, default_corpus, make_shards, open_shard
from agora_trainer.tokenizer import get_tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write the shards into")
    parser.add_argument("--shards", type=int, default=8, help="number of shards (default 8)")
    parser.add_argument(
        "--source", type=Path, action="append", help=f"text file or folder (default: {default_corpus()})"
    )
    parser.add_argument("--tokenizer", default="bytes", help="tokenizer name (default: bytes)")
    parser.add_argument("--max-mb", type=float, help="stop after this many MB of text")
    parser.add_argument("--seed", type=int, default=0, help="file shuffling seed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        metas = make_shards(
            args.out_dir,
            shards=args.shards,
            tokenizer=get_tokenizer(args.tokenizer),
            sources=args.source,
            seed=args.seed,
            max_bytes=int(args.max_mb * 1e6) if args.max_mb else None,
            progress=lambda line: print(f"  {line}", flush=True),
        )
    except (ShardError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = sum(len(open_shard(m).tokens) for m in metas)
    print(
        f"wrote {len(metas)} shards, {tokens / 1e6:.2f} M tokens, to {args.out_dir} in {time.monotonic() - started:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
