#!/usr/bin/env python3
"""Data benchmark: shard-making throughput, BPE vs bytes, and a trainer's cost to read a sample.

    python benchmarks/data.py [--mb 8] [--workers N] [--seconds 4] [--json] [--smoke]

Shard making: ``make_shards`` on the first --mb MB of the default corpus (the standard
library's sources), MB of text per second with --workers tokenizing processes (default: one
per CPU), for the byte tokenizer (the baseline) and for examples/tiny.toml's BPE (512 ids,
given, so learning it is timed apart), and the BPE with one process (what the workers buy).

Sample reading: what a trainer spends per sample on its shards (``SampleCursor.take`` and
``complete``, its state written every 64 samples as the trainer does), CPU time over 20 000
samples of seq_len 128 from BPE shards, against one hop's routing cost measured in the same
run by benchmarks/routing.py's own measurement (8 lanes through 4 zero-compute stages): the
target is at most 5 % of a hop. Also the time to open and verify a shard set (BLAKE2b of
every shard), once per trainer start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

import _harness
from _report import Report  # benchmarks/ is on sys.path when a benchmark runs as a script
from agora_core.observability.logs import configure_logging
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.manifest import load_tokenizer
from agora_trainer.data.sharding import TrainBpe, make_shards
from agora_trainer.data.shards import open_shard_set
from agora_trainer.data.tokenizer import ByteTokenizer
from routing import run as routing_run

SEQ_LEN = 128  # examples/tiny.toml's
VOCAB = 512
READS = 20_000


def shard_rate(folder: Path, tokenizer, mb: float, workers: int) -> float:
    """MB of text per second that make_shards turns into shards."""
    started = time.perf_counter()
    manifest = make_shards(folder, shards=8, tokenizer=tokenizer, max_bytes=int(mb * 1e6), workers=workers)
    elapsed = time.perf_counter() - started
    return sum(s.text_bytes for s in manifest.shards) / 1e6 / elapsed


def read_cost_us(folder: Path) -> float:
    """CPU microseconds a trainer spends per sample on taking and completing it."""
    shards = open_shard_set(folder, "train").shards
    cursor = SampleCursor(shards, SEQ_LEN, folder / "state.json")
    count = min(READS, cursor.total)
    started = time.process_time()
    for _ in range(count):
        sample = cursor.take()
        cursor.complete(sample.id)  # writes the state file, as the trainer does after every sample
    return (time.process_time() - started) / count * 1e6


def hop_cost_us(seconds: float) -> float:
    """One trainer's CPU time per stage hop, as benchmarks/routing.py measures it."""
    routing = Report("routing", as_json=True)  # quiet: only its figure is taken
    asyncio.run(routing_run(routing, [8], seconds, 4))
    return next(f.value for f in routing.figures if f.name == "lanes=8 trainer_cpu_per_hop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="MB of text to shard (default 8)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=4.0, help="routing measurement length")
    parser.add_argument("--learn-mb", type=float, default=4.0, help="MB of text the BPE is learned from")
    _harness.add_arguments(parser, deadline_s=900)
    args = _harness.parse(parser, smoke={"mb": 0.5, "seconds": 0.5, "learn_mb": 0.3})
    configure_logging(fmt="console", level="warning")
    report = Report("data", as_json=args.json)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        report.note(f"learning a {VOCAB}-id BPE from {args.learn_mb:g} MB of the standard library's sources")
        started = time.perf_counter()
        make_shards(
            tmp / "learned",
            shards=1,
            tokenizer=TrainBpe(VOCAB),
            max_bytes=int(args.learn_mb * 1e6),
            workers=1,
        )
        learn_s = time.perf_counter() - started  # includes tokenizing that text once, in one process
        bpe = load_tokenizer(tmp / "learned", open_shard_set(tmp / "learned").tokenizer)
        report.add(f"bpe_learn_and_shard_{args.learn_mb:g}mb", learn_s, "s")
        report.note(f"sharding {args.mb:g} MB with {args.workers} workers: bytes, then BPE")
        bytes_rate = shard_rate(tmp / "bytes", ByteTokenizer(), args.mb, args.workers)
        report.add(f"make_shards bytes workers={args.workers}", bytes_rate, "MB/s")
        bpe_rate = shard_rate(tmp / "bpe", bpe, args.mb, args.workers)
        report.compare(
            f"make_shards bpe-{VOCAB} workers={args.workers}", bpe_rate, bytes_rate, "MB/s (vs bytes)"
        )
        one = shard_rate(tmp / "bpe-one", bpe, args.mb, 1)
        report.compare(
            f"make_shards bpe-{VOCAB} workers=1", one, bpe_rate, f"MB/s (vs workers={args.workers})"
        )
        started = time.perf_counter()
        opened = open_shard_set(tmp / "bpe", "train")
        verify_s = time.perf_counter() - started
        size_mb = sum(s.path.stat().st_size for s in opened.shards) / 1e6
        report.add(
            "open_and_verify_shards", size_mb / verify_s, f"MB/s ({size_mb:.1f} MB in {verify_s:.3f} s)"
        )
        report.note(f"reading {READS} samples of {SEQ_LEN} tokens; then one hop's routing cost (routing.py)")
        read_us = read_cost_us(tmp / "bpe")
        hop_us = hop_cost_us(args.seconds)
        report.add("routing hop cpu (routing.py, lanes=8)", hop_us, "us")
        report.compare(
            "sample read cpu per sample", read_us, hop_us, "us (vs one hop)", target="ratio <= 0.05"
        )
    report.finish()


if __name__ == "__main__":
    main()
