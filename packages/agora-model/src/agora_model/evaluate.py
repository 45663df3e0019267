"""What did the swarm learn? An exported model's held-out loss, and text sampled from it.

    python tools/evaluate.py MODEL.safetensors --shards DIR [--samples 256] [--prompt TEXT]
                             [--tokens 200] [--temperature 0.7] [--seed 0] [--json]

(``agora-model evaluate`` is the same command.)

The held-out loss is the mean next-token cross-entropy per token (nats) over evenly spaced
samples of the shard set's validation split: documents ``tools/make_shards.py`` held out,
which no trainer reads. It is also given in bits per byte of the text those tokens stand for,
which compares across tokenizers. The stages run in one process exactly as the swarm runs
them. The tokenizer is the one that made the shards (their manifest), checked against the
model's run config and, when the model file records one, against the model's own. The sample
continues --prompt greedily at --temperature 0, else sampled with --seed (the same seed, the
same text); it stops early at a document separator. MODEL comes from
``tools/export_model.py`` (or ``reference_train.py --export``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import click
import numpy as np

from agora_core.errors import AgoraError
from agora_trainer.data.held_out import bits_per_byte, label_bytes, validation_samples
from agora_trainer.data.manifest import check_model_tokenizer, check_run_tokenizer, load_tokenizer
from agora_trainer.data.shards import open_shard_set
from agora_worker.model.export import read_model
from agora_worker.model.inference import WholeModel, generate, held_out_loss


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--shards", "shards_dir", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--samples", type=int, default=256, show_default=True, help="Held-out samples to score.")
@click.option("--batch", type=int, default=16, show_default=True, help="Samples per forward pass.")
@click.option("--prompt", default="def ", show_default=True, help="Text to continue.")
@click.option("--tokens", type=int, default=200, show_default=True, help="Tokens to sample (0: none).")
@click.option("--temperature", type=float, default=0.7, show_default=True, help="0: greedy.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with the results at the end.")
def main(model_file, shards_dir, samples, batch, prompt, tokens, temperature, seed, as_json):
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
        held_out = open_shard_set(shards_dir, "validation")
        entry = held_out.tokenizer
        check_run_tokenizer(entry, run.data, run.model.vocab_size, where=str(shards_dir))
        check_model_tokenizer(exported.tokenizer, entry, model=str(model_file), where=str(shards_dir))
        tokenizer = load_tokenizer(shards_dir, entry)
        data = validation_samples(held_out, run.model.seq_len, samples)
        every = max(1, len(data) // 4)

        def progress(done: int, mean: float) -> None:
            if done % every < batch or done == len(data):
                click.echo(f"  scored {done}/{len(data)} samples: mean loss {mean:.4f}")

        loss = held_out_loss(model, data, batch_size=batch, progress=progress)
        token_bytes = tokenizer.token_bytes()
        bpb = bits_per_byte(loss, data, token_bytes)
        scored = len(data) * run.model.seq_len
        names = ", ".join(s.name for s in held_out.shards)
        click.echo(
            f"held-out loss: {loss:.4f} nats/token (perplexity {math.exp(loss):.2f}), {bpb:.4f} bits/byte, "
            f"on {len(data)} samples of the validation split ({names}: {scored} tokens, "
            f"{label_bytes(data, token_bytes)} bytes of text; tokenizer {entry.describe()})"
        )
        text = ""
        if tokens:
            ids = tokenizer.encode(prompt)
            ids = ids if len(ids) else np.array([tokenizer.separator])
            out = generate(
                model,
                ids,
                new_tokens=tokens,
                temperature=temperature,
                seed=seed,
                vocab_limit=tokenizer.vocab_size,
                stop_token=tokenizer.separator,
            )
            text = tokenizer.decode(out)
            how = "greedy" if temperature == 0 else f"temperature {temperature:g}, seed {seed}"
            click.echo(f"sample ({how}):")
            click.echo("  | " + (prompt + text).replace("\n", "\n  | "))
    except (AgoraError, ValueError) as exc:  # ModelFileError and the data errors are AgoraErrors
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        result = {
            "model": str(model_file),
            "steps": exported.steps,
            "held_out_loss": loss,
            "bits_per_byte": bpb,
            "held_out_shards": [s.name for s in held_out.shards],
            "samples": len(data),
            "tokenizer": entry.describe(),
            "prompt": prompt,
            "sample": text,
            "seconds": round(time.monotonic() - started, 2),
        }
        click.echo(json.dumps(result))
