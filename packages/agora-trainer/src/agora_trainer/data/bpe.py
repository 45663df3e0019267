"""A byte-level BPE trained on the run's own corpus, in seconds, with nothing downloaded.

GPT-2's recipe through the ``tokenizers`` library: text is split into words by GPT-2's
pattern, every byte is in the starting alphabet (so any text encodes, no unknown token), and
merges of the most frequent adjacent pairs are learned until the vocabulary holds
``vocab_size`` ids. Id 0 is the document separator ``<|endoftext|>``, as NUL is for the byte
tokenizer. No space is added before a document, so ``decode(encode(text)) == text``.
"""

from __future__ import annotations

from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from agora_core.config.run import BPE_MIN_VOCAB
from agora_trainer.data.tokenizer import JsonTokenizer
from agora_trainer.errors import TokenizerError

SEPARATOR_TOKEN = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int) -> JsonTokenizer:
    """A byte-level BPE of at most ``vocab_size`` ids learned from ``texts`` (fewer when the
    texts run out of pairs to merge; its id space stays ``vocab_size``)."""
    if vocab_size < BPE_MIN_VOCAB:
        raise TokenizerError(f"a byte-level BPE needs vocab_size >= {BPE_MIN_VOCAB}, got {vocab_size}")
    tokenizer = tokenizers.Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR_TOKEN],  # first, so it gets id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,  # a pair seen once is noise, not a token
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return JsonTokenizer(tokenizer.to_str(), kind="bpe", vocab_size=vocab_size, origin=f"bpe-{vocab_size}")
