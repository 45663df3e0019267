"""The centralized reference: the swarm's model trained in one process, for comparison.

    python tools/reference_train.py --config RUN.toml --shards DIR --samples N [--loss-log F]
                                    [--export MODEL.safetensors]

(``agora-model reference`` is the same command.)

Same seed and initial weights (every stage built by ``build_stage`` exactly as a worker
builds it), same stage-wise clipping, same AdamW and schedule (one ``HostOptimizer`` per
stage), one optimizer step per ``target_batch_size`` samples, and the trainer's sample
order: sample 0, 1, 2, ... of the shards in folder order. Each sample's loss is the loss its
forward pass saw, before the step its gradient goes into -- what a swarm trainer records.
The per-sample losses go to --loss-log as JSON lines ({"id", "loss"}), like
``agora-trainer run --loss-log``. --export writes the trained model in the format of
``tools/export_model.py``, so ``tools/evaluate.py`` scores both the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from agora_core.config import load_run_config
from agora_core.errors import ConfigError
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.manifest import check_run_tokenizer, tokenizer_record
from agora_trainer.data.shards import open_shard_set
from agora_trainer.errors import DataError, ShardError
from agora_worker.model import build_stage
from agora_worker.model.export import ExportedModel, weights_from_module, write_model
from agora_worker.optimizer.host import HostOptimizer


class ReferenceModel:
    """Every stage of the run in one process, trained as the swarm trains them."""

    def __init__(self, run):
        self.run = run
        n = run.model.n_stages
        self.stages = [build_stage(run, s) for s in range(n)]
        self.optimizers = [
            HostOptimizer(m, run.optimizer, clip_threshold=run.clipping.threshold(s, n))
            for s, m in enumerate(self.stages)
        ]

    def train_batch(self, samples: np.ndarray) -> np.ndarray:
        """Forward and backward a (B, T + 1) batch of samples; returns each sample's loss.
        Batch members do not interact, so this equals B single-sample passes."""
        tokens = torch.from_numpy(samples[:, :-1].astype(np.int64))
        labels = torch.from_numpy(samples[:, 1:].astype(np.int64))
        boundary = None
        for module in self.stages[:-1]:
            boundary = module(tokens, boundary)
        losses = self.stages[-1](tokens, boundary, labels)
        losses.sum().backward()  # the swarm sums per-sample losses too; the step divides by samples
        for optimizer in self.optimizers:
            optimizer.accumulate(len(samples))
        return losses.detach().numpy()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.apply()

    def export(self, path: Path, *, tokenizer: str = "") -> None:
        """The trained model as one file, like ``tools/export_model.py`` writes a swarm's;
        ``tokenizer``: the shards' tokenizer record."""
        weights = [weights_from_module(module) for module in self.stages]
        steps = [optimizer.step for optimizer in self.optimizers]
        model = ExportedModel(
            run=self.run, weights=weights, steps=steps, source="reference", tokenizer=tokenizer
        )
        write_model(path, model)


def train(
    run,
    shards_dir: str,
    samples: int,
    *,
    microbatch: int,
    loss_log: Path | None,
    every: int,
    export: Path | None = None,
) -> list:
    torch.manual_seed(run.seed)
    shard_set = open_shard_set(shards_dir, "train")  # as a trainer: verified, never the validation split
    check_run_tokenizer(shard_set.tokenizer, run.data, run.model.vocab_size, where=shards_dir)
    cursor = SampleCursor(shard_set.shards, run.model.seq_len, shuffle_seed=run.data.shuffle_seed)
    if samples > cursor.total:
        raise ShardError(
            f"the shards hold {cursor.total} samples of {run.model.seq_len} tokens; asked for {samples}"
        )
    model = ReferenceModel(run)
    target = run.optimizer.target_batch_size
    losses: list[float] = []
    started = time.monotonic()
    out = open(loss_log, "w") if loss_log else None
    try:
        while len(losses) < samples:
            # never cross a step boundary inside a microbatch: the step comes exactly every
            # target_batch_size samples, as in the swarm
            size = min(microbatch, samples - len(losses), target - len(losses) % target)
            taken = [cursor.take() for _ in range(size)]
            first = len(losses)
            for sample, loss in zip(
                taken, model.train_batch(np.stack([s.tokens for s in taken])), strict=True
            ):
                losses.append(float(loss))
                if out is not None:  # the sample's id, as a trainer's loss log has it
                    out.write(json.dumps({"id": sample.id, "loss": float(loss)}) + "\n")
            if len(losses) % target == 0:
                model.step()
            if every and (len(losses) // every) != (first // every):
                recent = np.mean(losses[-every:])
                rate = len(losses) / (time.monotonic() - started)
                print(f"samples {len(losses)}  loss {recent:.4f}  ({rate:.1f} samples/s)", flush=True)
    finally:
        if out is not None:
            out.close()
    if export is not None:
        model.export(export, tokenizer=tokenizer_record(shard_set.tokenizer))
        print(f"exported the trained model to {export}", flush=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="run config TOML")
    parser.add_argument("--shards", required=True, help="folder of data shards")
    parser.add_argument("--samples", type=int, required=True, help="samples to train on")
    parser.add_argument("--microbatch", type=int, default=16, help="samples per forward pass (default 16)")
    parser.add_argument("--loss-log", type=Path, help="write one JSON line per sample here")
    parser.add_argument("--print-every", type=int, default=64, help="status line every N samples (0: none)")
    parser.add_argument("--export", type=Path, help="write the trained model here (safetensors)")
    args = parser.parse_args(argv)
    try:
        run = load_run_config(args.config)
        if run.model.kind != "transformer":
            raise ConfigError("model.kind", "the reference trains transformer runs only")
        losses = train(
            run,
            args.shards,
            args.samples,
            microbatch=args.microbatch,
            loss_log=args.loss_log,
            every=args.print_every,
            export=args.export,
        )
    except (ConfigError, DataError) as exc:
        print(f"reference_train: {exc}", file=sys.stderr)
        return 2
    tail = losses[-min(len(losses), 64) :]
    print(
        f"done: {len(losses)} samples, first loss {losses[0]:.4f}, last {len(tail)} mean {np.mean(tail):.4f}"
    )
    return 0
