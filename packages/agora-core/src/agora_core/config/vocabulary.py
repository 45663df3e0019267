"""Does the model's vocabulary fit the run's tokenizer? What ``agora config check`` reports.

Every token id needs an embedding row and an LM-head row, so ``model.vocab_size`` below the
tokenizer's ids is refused; rows above them are never trained (a byte tokenizer under the
default 32 000 rows leaves 31 744 unused), which earns a warning. agora-core carries no
tokenizer library, so a ``tokenizer.json`` is read as plain JSON: its ids are those of its
model's vocabulary and of its added tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from agora_core.config.run import RunConfig
from agora_core.errors import ConfigError

# Padding the vocabulary to a round size is common (kernels like multiples of 64 or 128); more
# unused rows than this, or than a tenth of the tokenizer's ids, is worth a warning.
UNUSED_ROWS_TOLERATED = 128


@dataclass(frozen=True)
class VocabularyFit:
    tokenizer_ids: int
    model_rows: int

    @property
    def unused_rows(self) -> int:
        return self.model_rows - self.tokenizer_ids

    @property
    def warning(self) -> str | None:
        if self.unused_rows <= max(UNUSED_ROWS_TOLERATED, self.tokenizer_ids // 10):
            return None
        return (
            f"model.vocab_size {self.model_rows} leaves {self.unused_rows} embedding and LM-head rows "
            f"that the tokenizer's {self.tokenizer_ids} ids never use; set it to {self.tokenizer_ids}"
        )


def tokenizer_file_ids(path: str | Path) -> int:
    """The number of ids (highest id + 1) of a Hugging Face ``tokenizer.json``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("data.tokenizer", f"tokenizer file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ConfigError("data.tokenizer", f"tokenizer file {path} is not readable JSON ({exc})") from None
    vocab = data.get("model", {}).get("vocab") if isinstance(data, dict) else None
    ids: list[int] = []
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        ids = [i for i in vocab.values() if isinstance(i, int)]
    elif isinstance(vocab, list):  # Unigram: [token, score] pairs, the id is the position
        ids = [len(vocab) - 1] if vocab else []
    ids += [
        t["id"]
        for t in data.get("added_tokens") or []
        if isinstance(t, dict) and isinstance(t.get("id"), int)
    ]
    if not ids:
        raise ConfigError("data.tokenizer", f"tokenizer file {path} holds no vocabulary (model.vocab)")
    return max(ids) + 1


def vocabulary_fit(run: RunConfig) -> VocabularyFit:
    """The tokenizer's ids against the model's rows; ConfigError if the model has too few."""
    ids = run.data.known_vocab_size
    if ids is None:
        ids = tokenizer_file_ids(run.data.tokenizer)
    if run.model.vocab_size < ids:
        raise ConfigError(
            "model.vocab_size",
            f"{run.model.vocab_size} is smaller than the tokenizer's {ids} ids ({run.data.tokenizer})",
        )
    return VocabularyFit(tokenizer_ids=ids, model_rows=run.model.vocab_size)
