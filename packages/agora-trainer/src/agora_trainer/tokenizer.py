"""Tokenizers turn text into token ids. The default needs no download: UTF-8 bytes."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    name: str
    vocab_size: int

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: np.ndarray) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte: 256 ids, nothing to download, every text representable."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()

    def decode(self, ids: np.ndarray) -> str:
        return bytes(np.asarray(ids, dtype=np.uint8)).decode("utf-8", errors="replace")


TOKENIZERS: dict[str, type] = {"bytes": ByteTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    try:
        return TOKENIZERS[name]()
    except KeyError:
        raise ValueError(f"unknown tokenizer {name!r}; available: {', '.join(TOKENIZERS)}") from None
