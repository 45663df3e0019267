"""Tokenizers, verified shards, the held-out split's scoring, and the resumable cursor."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from agora_core.config import parse_run_config
from agora_trainer.data.bpe import train_bpe
from agora_trainer.data.cursor import SampleCursor
from agora_trainer.data.held_out import bits_per_byte, label_bytes, validation_samples
from agora_trainer.data.manifest import (
    MANIFEST,
    check_model_tokenizer,
    check_run_tokenizer,
    load_tokenizer,
    read_manifest,
    tokenizer_record,
)
from agora_trainer.data.sharding import make_shards
from agora_trainer.data.shards import SEPARATOR, open_shard_set, open_shards
from agora_trainer.data.tokenizer import ByteTokenizer, JsonTokenizer
from agora_trainer.errors import ShardCorrupt, ShardError, TokenizerError

UNICODE = "def f(x):\n    return x ** 2  # ünïcode ✓ \U0001d518 <|endoftext|>\n"


def corpus(tmp_path, files: int = 6, size: int = 3000):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(files):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "héllo wörld " * (size // 12))
    return src


def byte_shards(tmp_path, out: str, shards: int, fraction: float = 0.0):
    """Shards of ``corpus(tmp_path)`` (made once per test) in tmp_path / out, byte-tokenized."""
    source = tmp_path / "src" if (tmp_path / "src").exists() else corpus(tmp_path)
    make_shards(
        tmp_path / out,
        shards=shards,
        tokenizer=ByteTokenizer(),
        sources=[source],
        validation_fraction=fraction,
    )
    return tmp_path / out


@pytest.fixture(scope="module")
def bpe() -> JsonTokenizer:
    texts = [f"def function_{i}(value):\n    return value * {i}  # héllo\n" * 20 for i in range(50)]
    return train_bpe(texts, 300)


def test_byte_tokenizer_round_trips_any_text_and_counts_a_byte_per_token():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids.dtype == np.uint8 and tok.vocab_size == 256 and tok.separator == SEPARATOR == 0
    assert tok.decode(ids) == UNICODE
    assert tok.token_bytes()[ids].sum() == len(UNICODE.encode()) and tok.token_bytes()[0] == 0


def test_a_learned_bpe_round_trips_any_text_and_knows_each_tokens_bytes(bpe):
    ids = bpe.encode(UNICODE)
    assert bpe.decode(ids) == UNICODE  # unseen characters too: every byte is in the alphabet
    assert bpe.separator == 0 and 0 not in ids  # "<|endoftext|>" in a text is text
    assert bpe.token_bytes()[ids].sum() == len(UNICODE.encode())  # exact for a byte-level BPE
    common = "def function_7(value):\n    return value * 7"
    assert len(bpe.encode(common)) < len(common.encode()) / 2  # it learned merges
    assert bpe.vocab_size == 300 and int(bpe.encode(common * 9).max()) < 300
    again = JsonTokenizer(bpe.to_json(), kind="bpe", vocab_size=300)  # what a worker process rebuilds
    assert list(again.encode_batch([common, UNICODE])[1]) == list(ids)


def test_a_tokenizer_file_that_is_missing_or_not_a_tokenizer_is_refused_naming_it(tmp_path, bpe):
    with pytest.raises(TokenizerError, match=r"tokenizer file .*none\.json does not exist"):
        JsonTokenizer.from_file(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match=r"bad.json is not a tokenizer.json"):
        JsonTokenizer.from_file(tmp_path / "bad.json")
    (tmp_path / "plain.json").write_text(bpe.to_json().replace("<|endoftext|>", "<|start|>"))
    with pytest.raises(TokenizerError, match=r"no end-of-document token"):
        JsonTokenizer.from_file(tmp_path / "plain.json")


def test_shards_record_their_tokenizer_counts_and_digests_in_one_manifest(tmp_path, bpe):
    manifest = make_shards(
        tmp_path / "out", shards=3, tokenizer=bpe, sources=[corpus(tmp_path)], validation_fraction=0
    )
    shards = open_shards(tmp_path / "out")
    assert [s.name for s in shards] == ["shard-00000", "shard-00001", "shard-00002"]
    assert all(s.documents == 2 for s in shards) and manifest.documents["train"] == 6
    assert read_manifest(tmp_path / "out") == manifest
    assert manifest.tokenizer.kind == "bpe" and manifest.dtype == "uint16"
    tokenizer = load_tokenizer(tmp_path / "out", manifest.tokenizer)
    text = tokenizer.decode(np.asarray(shards[0].tokens))
    assert text.startswith("document ") and np.count_nonzero(np.asarray(shards[0].tokens) == 0) == 1
    assert sum(s.entry.text_bytes for s in shards) == sum(
        len(p.read_bytes()) for p in (tmp_path / "src").iterdir()
    )


def test_a_shard_whose_bytes_were_altered_is_refused_naming_the_shard(tmp_path):
    byte_shards(tmp_path, ".", 2)
    data = tmp_path / "shard-00001.tokens"
    original = data.read_bytes()
    data.write_bytes(original[:100] + bytes([original[100] ^ 1]) + original[101:])  # same size, one bit
    with pytest.raises(ShardCorrupt, match=r"shard shard-00001 \(.*\) was altered: its BLAKE2b digest"):
        open_shards(tmp_path)
    data.write_bytes(original[:-10])
    with pytest.raises(ShardCorrupt, match=r"shard shard-00001 .* holds .* bytes; its manifest says"):
        open_shards(tmp_path)
    data.unlink()
    with pytest.raises(ShardError, match=r"shard shard-00001 .* is missing"):
        open_shards(tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(ShardError, match=r"holds shards but no manifest.json"):
        open_shards(tmp_path)
    with pytest.raises(ShardError, match=r"no shards in"):
        open_shards(tmp_path / "src")


def test_a_run_never_mixes_tokenizers(tmp_path, bpe):
    make_shards(tmp_path / "b", shards=1, tokenizer=bpe, sources=[corpus(tmp_path)], validation_fraction=0)
    entry = read_manifest(tmp_path / "b").tokenizer
    bpe_run = parse_run_config('[model]\nvocab_size = 300\n[data]\ntokenizer = "bpe"\nvocab_size = 300\n')
    check_run_tokenizer(entry, bpe_run.data, 300, where="b")
    with pytest.raises(
        TokenizerError, match=r"made with bpe .*300 ids\); the run's data.tokenizer is 'bytes'"
    ):
        check_run_tokenizer(entry, parse_run_config("").data, 32000, where="b")
    other_size = parse_run_config('[model]\nvocab_size = 512\n[data]\ntokenizer = "bpe"\nvocab_size = 512\n')
    with pytest.raises(TokenizerError, match=r"data.vocab_size is 512"):
        check_run_tokenizer(entry, other_size.data, 512, where="b")
    with pytest.raises(TokenizerError, match=r"model.vocab_size 299 has too few rows"):
        check_run_tokenizer(entry, bpe_run.data, 299, where="b")
    # A user's tokenizer.json: the run names a file, and it must be the very one.
    mine = tmp_path / "mine.json"
    mine.write_text(bpe.to_json())
    as_file = parse_run_config(f'[model]\nvocab_size = 300\n[data]\ntokenizer = "{mine}"\n')
    make_shards(tmp_path / "f", shards=1, tokenizer=JsonTokenizer.from_file(mine), sources=[tmp_path / "src"])
    file_entry = read_manifest(tmp_path / "f").tokenizer
    check_run_tokenizer(file_entry, as_file.data, 300, where="f")
    mine.write_text(bpe.to_json().replace('"ByteLevel"', '"ByteLevel" '))
    with pytest.raises(TokenizerError, match=r"mine.json is another tokenizer"):
        check_run_tokenizer(file_entry, as_file.data, 300, where="f")
    mine.unlink()
    with pytest.raises(TokenizerError, match=r"mine.json does not exist"):
        check_run_tokenizer(file_entry, as_file.data, 300, where="f")
    # The shards' own tokenizer.json, missing or altered; a model trained on other shards.
    with pytest.raises(
        TokenizerError, match=r"was trained on shards of file .* the shards in b were made with bpe"
    ):
        check_model_tokenizer(tokenizer_record(file_entry), entry, model="m.safetensors", where="b")
    check_model_tokenizer(tokenizer_record(entry), entry, model="m.safetensors", where="b")
    (tmp_path / "b" / "tokenizer.json").write_text(bpe.to_json() + " ")
    with pytest.raises(TokenizerError, match=r"is not the tokenizer that made these shards"):
        load_tokenizer(tmp_path / "b", entry)
    (tmp_path / "b" / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match=r"b/tokenizer.json is missing"):
        load_tokenizer(tmp_path / "b", entry)


def test_bits_per_byte_divide_the_nats_by_the_text_the_tokens_stand_for(tmp_path):
    byte_shards(tmp_path, "out", 1, 0.5)
    held_out = open_shard_set(tmp_path / "out", "validation")
    samples = validation_samples(held_out, 64, 10)
    assert samples.shape == (10, 65) and len(np.unique(samples[:, 0])) > 1  # spread over the split
    assert len(validation_samples(held_out, 64, 10**6)) == held_out.shards[0].sample_count(64)
    token_bytes = ByteTokenizer().token_bytes()
    separators = int(np.count_nonzero(samples[:, 1:] == 0))
    assert label_bytes(samples, token_bytes) == samples[:, 1:].size - separators
    bpb = bits_per_byte(2.0, samples, token_bytes)
    assert bpb == pytest.approx(2.0 / math.log(2) * samples[:, 1:].size / (samples[:, 1:].size - separators))


def test_samples_overlap_by_one_token_for_the_next_token_labels(tmp_path):
    byte_shards(tmp_path, "out", 1)
    shard = open_shards(tmp_path / "out")[0]
    first, second = shard.sample(0, 16), shard.sample(1, 16)
    assert len(first) == 17 and first[-1] == second[0]
    assert shard.sample_count(16) == (len(shard.tokens) - 1) // 16


def test_cursor_resume_neither_repeats_nor_skips(tmp_path):
    byte_shards(tmp_path, "out", 2)
    shards = open_shards(tmp_path / "out")
    state = tmp_path / "state.json"
    cursor = SampleCursor(shards, 64, state)
    taken = [cursor.take() for _ in range(10)]
    for sample in taken[::2]:  # lanes finish out of order; the odd ones are in flight at the crash
        cursor.complete(sample.id)
    cursor.give_back(taken[1])  # one failed: handed back to run again, still outstanding
    assert sorted(cursor.outstanding()) == sorted(s.id for s in taken[1::2])
    cursor.save()
    restarted = SampleCursor(shards, 64, state)
    assert restarted.done == 5
    assert restarted.outstanding() == []  # nothing in flight in the new process yet
    assert all(restarted.holds(s.id) for s in taken[1::2])  # what was in flight is to run here
    assert not any(restarted.holds(s.id) for s in taken[::2])  # what was completed is not
    again = []
    while (sample := restarted.take()) is not None:
        again.append(sample.id)
        restarted.complete(sample.id)
    done_before = {s.id for s in taken[::2]}
    assert sorted(done_before | set(again)) == list(range(restarted.total))  # nothing skipped
    assert not done_before & set(again)  # nothing done twice
    assert restarted.finished and restarted.done == restarted.total


def test_a_crash_between_state_writes_loses_no_completion_the_journal_holds(tmp_path):
    byte_shards(tmp_path, "out", 2)
    shards = open_shards(tmp_path / "out")
    state = tmp_path / "state.json"
    cursor = SampleCursor(shards, 64, state)
    taken = [cursor.take() for _ in range(8)]
    for sample in taken[:6]:
        cursor.complete(sample.id)  # journaled: the state file was last written when the shard opened
    assert json.loads(state.read_text())["completed"] == 0
    with open(state.with_name("state.json.journal"), "a") as journal:
        journal.write("12")  # a line the crash cut short: that sample runs again
    restarted = SampleCursor(shards, 64, state)  # no save, no close: as after a kill
    assert restarted.done == 6
    again = [restarted.take().id for _ in range(2)]
    assert again == [s.id for s in taken[6:]]  # the two in flight at the crash, then new ones
    restarted.close()
    assert (
        json.loads(state.read_text())["completed"] == 6
        and state.with_name("state.json.journal").read_text() == ""
    )


def test_a_sample_given_back_comes_first_and_state_from_other_shards_is_refused(tmp_path):
    byte_shards(tmp_path, "out", 2)
    shards = open_shards(tmp_path / "out")
    cursor = SampleCursor(shards, 64, tmp_path / "state.json")
    first = cursor.take()
    cursor.give_back(first)
    assert cursor.take().id == first.id
    cursor.save()
    with pytest.raises(ShardError, match=r"another set of shards"):
        SampleCursor(shards[:1], 64, tmp_path / "state.json")
    with pytest.raises(ShardError, match=r"seq_len"):
        SampleCursor(shards, 32, tmp_path / "state.json")
    with pytest.raises(ShardError, match=r"shuffle_seed 0, the run uses 5"):
        SampleCursor(shards, 64, tmp_path / "state.json", shuffle_seed=5)
    (tmp_path / "src" / "doc0.txt").write_text("the same shard names, other documents")
    make_shards(tmp_path / "out", shards=2, tokenizer=ByteTokenizer(), sources=[tmp_path / "src"])
    with pytest.raises(ShardError, match=r"another set of shards"):  # remade: the digests differ
        SampleCursor(open_shards(tmp_path / "out"), 64, tmp_path / "state.json")
