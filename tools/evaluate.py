#!/usr/bin/env python3
"""What did the swarm learn? An exported model's held-out loss, and text sampled from it.

    python tools/evaluate.py MODEL.safetensors --shards DIR [--held-out-shard N] [--samples 256]
                             [--prompt TEXT] [--tokens 200] [--temperature 0.7] [--seed 0] [--json]

The loss is the mean next-token cross-entropy per token (nats) over evenly spaced samples of
one shard the run did not train on: by default the last shard in DIR, the one
``tools/swarm.py up`` keeps from its trainers. The stages run in one process exactly as the
swarm runs them. The sample continues --prompt with the run's tokenizer (bytes), greedily at
--temperature 0, else sampled with --seed (the same seed, the same text); it stops early at a
document separator. MODEL comes from ``tools/export_model.py`` (or ``reference_train.py
--export``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import click
import numpy as np

from agora_trainer.shards import SEPARATOR, ShardError, open_shards
from agora_trainer.tokenizer import get_tokenizer
from agora_worker.model.export import ModelFileError, read_model
from agora_worker.model.inference import WholeModel, generate, held_out_loss


def held_out_samples(shards_dir: Path, index: int, seq_len: int, count: int, *, tokenizer: str, vocab: int):
    """(shard name, (N, seq_len + 1) samples spread evenly over shard ``index`` of the folder)."""
    shards = open_shards(shards_dir)
    if not -len(shards) <= index < len(shards):
        raise ShardError(f"--held-out-shard {index}: {shards_dir} holds shards 0..{len(shards) - 1}")
    shard = shards[index]
    if shard.tokenizer != tokenizer or shard.vocab_size > vocab:
        raise ShardError(
            f"shard {shard.name} was made with tokenizer {shard.tokenizer!r} (vocab {shard.vocab_size}); "
            f"the model reads {tokenizer!r} (vocab {vocab})"
        )
    available = shard.sample_count(seq_len)
    if available == 0:
        raise ShardError(f"shard {shard.name} is shorter than one sample of {seq_len} tokens")
    picks = np.unique(np.linspace(0, available - 1, min(count, available)).round().astype(np.int64))
    return shard.name, np.stack([shard.sample(int(i), seq_len) for i in picks])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--shards", "shards_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--held-out-shard",
    type=int,
    default=-1,
    show_default=True,
    help="Shard index in --shards (-1: the last).",
)
@click.option("--samples", type=int, default=256, show_default=True, help="Held-out samples to score.")
@click.option("--batch", type=int, default=16, show_default=True, help="Samples per forward pass.")
@click.option("--prompt", default="def ", show_default=True, help="Text to continue.")
@click.option("--tokens", type=int, default=200, show_default=True, help="Tokens to sample (0: none).")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0: greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the results at the end.")
def main(model_file, shards_dir, held_out_shard, samples, batch, prompt, tokens, temperature, seed, as_json):
    """Report MODEL_FILE's held-out loss and sample text from it."""
    started = time.monotonic()
    try:
        if samples < 1 or batch < 1 or tokens < 0 or temperature < 0:
            raise ValueError("--samples and --batch must be >= 1, --tokens and --temperature >= 0")
        exported = read_model(model_file)
        run = exported.run
        model = WholeModel(exported.modules(), seq_len=run.model.seq_len)
        click.echo(
            f"model {model_file}: run {run.name!r}, {run.model.n_stages} stages at steps {exported.steps}, "
            f"{exported.parameters / 1e6:.2f} M parameters (from {exported.source or 'unknown'})"
        )
        tokenizer = get_tokenizer(run.data.tokenizer)
        shard, data = held_out_samples(
            shards_dir,
            held_out_shard,
            run.model.seq_len,
            samples,
            tokenizer=tokenizer.name,
            vocab=run.model.vocab_size,
        )
        every = max(1, len(data) // 4)

        def progress(done: int, mean: float) -> None:
            if done % every < batch or done == len(data):
                click.echo(f"  scored {done}/{len(data)} samples: mean loss {mean:.4f}")

        loss = held_out_loss(model, data, batch_size=batch, progress=progress)
        click.echo(
            f"held-out loss: {loss:.4f} nats/token (perplexity {math.exp(loss):.2f}) on {len(data)} samples "
            f"of {shard} ({len(data) * run.model.seq_len} tokens)"
        )
        text = ""
        if tokens:
            ids = tokenizer.encode(prompt)
            ids = ids if len(ids) else np.array([SEPARATOR])
            out = generate(
                model,
                ids,
                new_tokens=tokens,
                temperature=temperature,
                seed=seed,
                vocab_limit=tokenizer.vocab_size,
                stop_token=SEPARATOR,
            )
            text = tokenizer.decode(out)
            how = "greedy" if temperature == 0 else f"temperature {temperature:g}, seed {seed}"
            click.echo(f"sample ({how}):")
            click.echo("  | " + (prompt + text).replace("\n", "\n  | "))
    except (ModelFileError, ShardError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        result = {
            "model": str(model_file),
            "steps": exported.steps,
            "held_out_loss": loss,
            "held_out_shard": shard,
            "samples": len(data),
            "prompt": prompt,
            "sample": text,
            "seconds": round(time.monotonic() - started, 2),
        }
        click.echo(json.dumps(result))


if __name__ == "__main__":
    main()
