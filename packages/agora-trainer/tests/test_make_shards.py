"""Any corpus into shards: JSON lines (plain and gzipped), Parquet, text folders; exact
duplicates dropped, a validation split held out, the same shards whatever the worker count;
bad input refused naming the file and line. The tools run as a user runs them."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agora_trainer.data.manifest import load_tokenizer, read_manifest
from agora_trainer.data.sharding import TrainBpe, is_validation, make_shards
from agora_trainer.data.shards import open_shard_set
from agora_trainer.data.tokenizer import ByteTokenizer
from agora_trainer.errors import CorpusError

ROOT = Path(__file__).resolve().parents[3]
WORDS = "the a shard token model swarm stage worker trainer gradient average loss byte merge über ✓".split()


def documents(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"record {i}: " + " ".join(rng.choices(WORDS, k=rng.randint(20, 60))) for i in range(count)]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, field: text}) + "\n")
    return path


def texts_of(directory: Path, split: str) -> list[str]:
    """Every document of ``split`` in ``directory``, decoded."""
    shard_set = open_shard_set(directory, split)
    tokenizer = load_tokenizer(directory, shard_set.tokenizer)
    out = []
    for shard in shard_set.shards:
        ids = np.asarray(shard.tokens)
        for part in np.split(ids, np.flatnonzero(ids == tokenizer.separator)):
            out.append(tokenizer.decode(part[part != tokenizer.separator]))
    return out


def test_make_shards_turns_a_jsonl_of_thousands_of_documents_into_verified_shards(tmp_path):
    unique = documents(3000)
    corpus = unique + unique[:150]  # 150 exact duplicates, at the end
    source = write_jsonl(tmp_path / "corpus.jsonl", corpus)
    command = [
        sys.executable,
        str(ROOT / "tools" / "make_shards.py"),
        str(tmp_path / "cli"),
        "--source",
        str(source),
    ]
    command += ["--tokenizer", "bpe", "--vocab-size", "512", "--shards", "4", "--validation-fraction", "0.05"]
    made = subprocess.run([*command, "--workers", "2"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    assert "wrote 4 training shard(s)" in made.stdout and "150 duplicates dropped" in made.stdout
    manifest = read_manifest(tmp_path / "cli")
    assert manifest.documents == {
        "read": 3150,
        "duplicates": 150,
        "skipped": 0,
        "train": 2850,
        "validation": 150,
    }
    assert manifest.tokenizer.kind == "bpe" and manifest.tokenizer.vocab_size == 512
    held_out = {t for i, t in enumerate(unique) if is_validation(i, 0.05)}
    assert sorted(texts_of(tmp_path / "cli", "validation")) == sorted(held_out)
    assert sorted(texts_of(tmp_path / "cli", "train")) == sorted(set(unique) - held_out)  # each once
    # The same shards from one process: results are taken in corpus order.
    alone = make_shards(
        tmp_path / "one",
        shards=4,
        tokenizer=TrainBpe(512),
        sources=[source],
        validation_fraction=0.05,
        workers=1,
    )
    assert [s.blake2b for s in alone.shards] == [s.blake2b for s in manifest.shards]
    assert alone.tokenizer.blake2b == manifest.tokenizer.blake2b


def test_the_validation_split_is_an_exact_evenly_spread_fraction():
    held = [i for i in range(1000) if is_validation(i, 0.01)]
    assert held == list(range(49, 1000, 100))  # the first halfway into the first hundred
    assert sum(is_validation(i, 0.3) for i in range(1000)) == 300
    assert not any(is_validation(i, 0.0) for i in range(100))


def test_gzipped_jsonl_with_another_field_and_text_folders_mix_in_one_corpus(tmp_path):
    write_jsonl(tmp_path / "a.jsonl.gz", ["gzipped one", "", "gzipped two"], field="content")
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "x.txt").write_text("plain text file")
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00 not utf-8")
    (folder / "ignored.bin").write_bytes(b"not a text suffix")
    manifest = make_shards(
        tmp_path / "out",
        shards=1,
        tokenizer=ByteTokenizer(),
        sources=[tmp_path / "a.jsonl.gz", folder],
        text_field="content",
        validation_fraction=0,
    )
    assert sorted(texts_of(tmp_path / "out", "train")) == ["gzipped one", "gzipped two", "plain text file"]
    assert manifest.documents["skipped"] == 2  # the empty record and the non-UTF-8 file


def test_bad_records_are_refused_naming_the_file_and_line(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", documents(5))
    with source.open("a") as f:
        f.write('{"id": 5, "body": "no text field"}\n')
    with pytest.raises(CorpusError, match=r"docs\.jsonl:6: no 'text' field \(it has 'id', 'body'"):
        make_shards(tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[source])
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(CorpusError, match=r"broken\.jsonl:2: not a JSON object"):
        make_shards(
            tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[tmp_path / "broken.jsonl"]
        )
    (tmp_path / "numbers.jsonl").write_text('{"text": 3}\n')
    with pytest.raises(CorpusError, match=r"numbers\.jsonl:1: field 'text' holds a int"):
        make_shards(
            tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[tmp_path / "numbers.jsonl"]
        )
    with pytest.raises(CorpusError, match=r"source .*absent does not exist"):
        make_shards(tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[tmp_path / "absent"])
    made = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "make_shards.py"),
            str(tmp_path / "cli"),
            "--source",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 2 and "docs.jsonl:6: no 'text' field" in made.stderr
    assert "Traceback" not in made.stderr


def test_parquet_is_read_where_pyarrow_is_installed_and_named_where_it_is_not(tmp_path):
    path = tmp_path / "docs.parquet"
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        path.write_bytes(b"PAR1")  # pyarrow is an optional extra: its absence is a clear error
        with pytest.raises(CorpusError, match=r"pip install agora-trainer\[parquet\]"):
            make_shards(tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[path])
        return
    pq.write_table(pa.table({"text": ["first", None, "second", "first"]}), path)
    manifest = make_shards(
        tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[path], validation_fraction=0
    )
    assert sorted(texts_of(tmp_path / "out", "train")) == ["first", "second"]
    assert manifest.documents["duplicates"] == 1 and manifest.documents["skipped"] == 1
    with pytest.raises(CorpusError, match=r"docs\.parquet has no column 'body' \(columns: text\)"):
        make_shards(tmp_path / "out", shards=1, tokenizer=ByteTokenizer(), sources=[path], text_field="body")


def test_a_trainer_refuses_an_altered_shard_before_it_joins_anything(tmp_path):
    make_shards(
        tmp_path / "shards",
        shards=2,
        tokenizer=TrainBpe(300),
        sources=[write_jsonl(tmp_path / "d.jsonl", documents(200))],
    )
    data = tmp_path / "shards" / "shard-00000.tokens"
    raw = bytearray(data.read_bytes())
    raw[7] ^= 0x10
    data.write_bytes(bytes(raw))
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvocab_size = 300\n[data]\ntokenizer = "bpe"\nvocab_size = 300\n')
    trainer = subprocess.run(
        [
            sys.executable,
            "-m",
            "agora_trainer",
            "run",
            "--config",
            str(config),
            "--shards",
            str(tmp_path / "shards"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert trainer.returncode == 1, trainer.stdout + trainer.stderr
    assert "shard shard-00000" in trainer.stderr and "was altered" in trainer.stderr
    assert "Traceback" not in trainer.stderr
