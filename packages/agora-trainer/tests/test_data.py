"""Tokenizer, shards and the resumable cursor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from agora_trainer.cursor import SampleCursor
from agora_trainer.shards import SEPARATOR, ShardError, make_shards, open_shard, open_shards
from agora_trainer.tokenizer import ByteTokenizer, get_tokenizer


def corpus(tmp_path, files: int = 6, size: int = 3000):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "héllo wörld " * (size // 12))
    return src


def test_byte_tokenizer_round_trips_any_text():
    tok = get_tokenizer("bytes")
    text = "def f(x):\n    return x ** 2  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and tok.vocab_size == 256
    assert tok.decode(ids) == text
    with pytest.raises(ValueError, match="unknown tokenizer"):
        get_tokenizer("bpe-9000")


def test_make_shards_balances_documents_and_records_metadata(tmp_path):
    metas = make_shards(tmp_path / "out", shards=3, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    shards = open_shards(tmp_path / "out")
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    assert sum(s.documents for s in shards) == 6 and all(s.documents == 2 for s in shards)
    meta = json.loads(metas[0].read_text())
    assert (
        meta["tokenizer"] == "bytes" and meta["dtype"] == "uint8" and meta["tokens"] == len(shards[0].tokens)
    )
    text = ByteTokenizer().decode(np.asarray(shards[0].tokens))
    assert "document" in text and text.count("\x00") == 1  # one separator between its two documents
    assert SEPARATOR == 0


def test_default_corpus_is_the_standard_library(tmp_path):
    metas = make_shards(tmp_path, shards=2, tokenizer=ByteTokenizer(), max_bytes=200_000)
    shard = open_shard(metas[0])
    assert b"def " in bytes(np.asarray(shard.tokens[:100_000]))
    assert "python" in shard.source.lower()


def test_broken_shards_are_refused_with_the_reason(tmp_path):
    make_shards(tmp_path, shards=1, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    data = tmp_path / "shard-00000.tokens"
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(ShardError, match="metadata says"):
        open_shards(tmp_path)
    with pytest.raises(ShardError, match="no shards"):
        open_shards(tmp_path / "src")


def test_other_json_files_beside_the_shards_are_not_shards(tmp_path):
    make_shards(tmp_path, shards=2, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    (tmp_path / "notes.json").write_text("{}")  # a trainer's state file, say
    assert [s.name for s in open_shards(tmp_path)] == ["shard-00000", "shard-00001"]


def test_samples_overlap_by_one_token_for_the_next_token_labels(tmp_path):
    make_shards(tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    shard = open_shards(tmp_path / "out")[0]
    first, second = shard.sample(0, 16), shard.sample(1, 16)
    assert len(first) == 17 and first[-1] == second[0]
    assert shard.sample_count(16) == (len(shard.tokens) - 1) // 16


def test_cursor_resume_neither_repeats_nor_skips(tmp_path):
    make_shards(tmp_path / "out", shards=2, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    shards = open_shards(tmp_path / "out")
    state = tmp_path / "state.json"
    cursor = SampleCursor(shards, 64, state)
    taken = [cursor.take() for _ in range(10)]
    for sample in taken[::2]:  # lanes finish out of order; the odd ones are in flight at the crash
        cursor.complete(sample.id)
    cursor.save()
    restarted = SampleCursor(shards, 64, state)
    assert restarted.done == 5
    again = []
    while (sample := restarted.take()) is not None:
        again.append(sample.id)
        restarted.complete(sample.id)
    done_before = {s.id for s in taken[::2]}
    assert sorted(done_before | set(again)) == list(range(restarted.total))  # nothing skipped
    assert not done_before & set(again)  # nothing done twice
    assert restarted.exhausted and restarted.watermark == restarted.total


def test_a_sample_given_back_comes_first_and_state_from_other_shards_is_refused(tmp_path):
    make_shards(tmp_path / "out", shards=2, tokenizer=ByteTokenizer(), sources=[corpus(tmp_path)])
    shards = open_shards(tmp_path / "out")
    cursor = SampleCursor(shards, 64, tmp_path / "state.json")
    first = cursor.take()
    cursor.give_back(first)
    assert cursor.take().id == first.id
    cursor.save()
    with pytest.raises(ValueError, match="another set of shards"):
        SampleCursor(shards[:1], 64, tmp_path / "state.json")
    with pytest.raises(ValueError, match="seq_len"):
        SampleCursor(shards, 32, tmp_path / "state.json")
