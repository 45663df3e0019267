"""Tokenizers turn text into token ids: UTF-8 bytes, or a Hugging Face ``tokenizer.json``.

Two kinds, one interface. ``ByteTokenizer`` needs nothing: 256 ids, every text representable.
``JsonTokenizer`` wraps the ``tokenizers`` library (Rust, no torch) around a tokenizer.json,
either one a user brings (kind ``file``) or the byte-level BPE that ``agora_trainer.data.bpe``
trains on the run's corpus (kind ``bpe``). Either way each document ends with a separator id,
and every id knows how many UTF-8 bytes of text it stands for, so a loss per token converts
to bits per byte, which compares across tokenizers.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol

import numpy as np
import tokenizers

from agora_trainer.errors import TokenizerError

# End-of-document tokens of common tokenizer.json files, in the order they are looked for.
SEPARATOR_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")


class Tokenizer(Protocol):
    kind: str  # "bytes", "bpe" or "file"
    vocab_size: int  # ids are below this
    separator: int  # the id between documents

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...

    def token_bytes(self) -> np.ndarray:
        """(vocab_size,) UTF-8 bytes of text each id stands for; 0 for the separator."""
        ...

    def to_json(self) -> str | None:
        """The tokenizer.json text that rebuilds it (None: the byte tokenizer needs none)."""
        ...


def digest(data: bytes) -> str:
    """BLAKE2b-256 as hex: the digest manifests record for shards and tokenizers."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


class ByteTokenizer:
    """One token per UTF-8 byte: 256 ids, nothing to download. Documents end with NUL (id 0),
    which text never holds."""

    kind = "bytes"
    vocab_size = 256
    separator = 0

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.separator] = 0
        return lengths

    def to_json(self) -> None:
        return None


class JsonTokenizer:
    """A Hugging Face tokenizer.json, run by the ``tokenizers`` library."""

    def __init__(self, text: str, *, kind: str, vocab_size: int | None = None, origin: str = ""):
        """``text``: the tokenizer.json; ``vocab_size``: the id space (default: the tokenizer's
        own ids; a trained BPE may hold fewer than the run asked for); ``origin``: where it came
        from, for messages."""
        self.origin = origin or kind
        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(text)
        except Exception as exc:  # the library raises plain Exceptions for any bad file
            raise TokenizerError(
                f"{self.origin} is not a tokenizer.json the tokenizers library reads: {exc}"
            ) from None
        self._text = text
        self.kind = kind
        # Text that happens to hold "<|endoftext|>" is text: never turned into the separator.
        self._tokenizer.encode_special_tokens = True
        own = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = own if vocab_size is None else vocab_size
        if own > self.vocab_size:
            raise TokenizerError(f"{self.origin} has {own} ids, more than the {self.vocab_size} expected")
        self.separator = self._find_separator()

    @classmethod
    def from_file(
        cls, path: str | Path, *, kind: str = "file", vocab_size: int | None = None
    ) -> JsonTokenizer:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise TokenizerError(f"tokenizer file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenizerError(f"tokenizer file {path} is not readable: {exc}") from None
        return cls(text, kind=kind, vocab_size=vocab_size, origin=str(path))

    def _find_separator(self) -> int:
        for name in SEPARATOR_NAMES:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is not None:
                return token_id
        raise TokenizerError(
            f"{self.origin} has no end-of-document token to separate documents with "
            f"(looked for {', '.join(SEPARATOR_NAMES)})"
        )

    def encode(self, text: str) -> np.ndarray:
        return np.array(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Many documents at once, without the character offsets ``encode`` would compute."""
        encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in np.asarray(ids).reshape(-1)], skip_special_tokens=True)

    def token_bytes(self) -> np.ndarray:
        lengths = np.zeros(self.vocab_size, dtype=np.int64)
        special = {t.content for t in self._tokenizer.get_added_tokens_decoder().values() if t.special}
        byte_level = (json.loads(self._text).get("decoder") or {}).get("type") == "ByteLevel"
        for token_id in range(self._tokenizer.get_vocab_size(with_added_tokens=True)):
            token = self._tokenizer.id_to_token(token_id)
            if token is None or token in special:
                continue
            if byte_level:  # each character of a byte-level token is one byte: exact
                lengths[token_id] = len(token)
            else:  # other decoders: the token decoded alone (close; word-boundary spaces may differ)
                lengths[token_id] = len(self._tokenizer.decode([token_id]).encode("utf-8"))
        return lengths

    def to_json(self) -> str:
        return self._text
