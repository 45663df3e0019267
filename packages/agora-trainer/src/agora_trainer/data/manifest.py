"""A shard set's manifest: which tokenizer made it, and every shard's split, counts and digest.

A shard set is a folder: ``manifest.json``, one ``<name>.tokens`` file per shard (token ids
back to back, little-endian, of ``dtype``) and, for a BPE or a user's tokenizer, the
``tokenizer.json`` that made them. ``manifest.json`` (format ``agora-shards-v2``):

    {"format": "agora-shards-v2", "dtype": "uint16", "seed": 0, "source": ["..."],
     "validation_fraction": 0.01,
     "tokenizer": {"kind": "bpe", "vocab_size": 1024, "separator": 0, "file": "tokenizer.json",
                   "blake2b": "<hex>", "origin": "bpe-1024 trained on 4.0 MB of the corpus"},
     "documents": {"read": 900, "duplicates": 3, "skipped": 2, "train": 886, "validation": 9},
     "shards": [{"id": 0, "name": "shard-00000", "split": "train", "tokens": 512000,
                 "documents": 110, "text_bytes": 1310720, "blake2b": "<hex>"}, ...]}

Shard ids are stable names for a shard (what an operator hands out to trainers); the digests
are BLAKE2b-256 of each ``.tokens`` file and of ``tokenizer.json``, checked when a shard set is
opened. Samples are counted from ``tokens`` for any sequence length: ``(tokens - 1) // seq_len``.
Validation shards hold documents no training shard holds; trainers never open them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agora_core.config import DataConfig
from agora_trainer.data.tokenizer import ByteTokenizer, JsonTokenizer, Tokenizer, digest
from agora_trainer.errors import ShardError, TokenizerError

FORMAT = "agora-shards-v2"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "validation")


@dataclass(frozen=True)
class TokenizerEntry:
    kind: str  # "bytes", "bpe" or "file" (a user's tokenizer.json)
    vocab_size: int  # ids are below this
    separator: int  # the id between documents
    file: str | None = None  # the tokenizer.json in the shard folder (None: bytes)
    blake2b: str | None = None  # of that file
    origin: str = ""  # what it is: "bytes", "bpe-1024 trained on ...", the user's path

    def describe(self) -> str:
        return "bytes" if self.kind == "bytes" else f"{self.kind} ({self.origin}, {self.vocab_size} ids)"


@dataclass(frozen=True)
class ShardEntry:
    id: int
    name: str  # its file is <name>.tokens
    split: str  # "train" or "validation"
    tokens: int
    documents: int
    text_bytes: int  # UTF-8 bytes of the documents it holds
    blake2b: str

    def sample_count(self, seq_len: int) -> int:
        return max(0, (self.tokens - 1) // seq_len)


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerEntry
    dtype: str
    shards: tuple[ShardEntry, ...]
    seed: int = 0
    source: tuple[str, ...] = ()
    validation_fraction: float = 0.0
    documents: dict[str, int] = field(default_factory=dict)

    def split(self, name: str) -> list[ShardEntry]:
        if name not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
        return [s for s in self.shards if s.split == name]

    def to_json(self) -> str:
        data = {"format": FORMAT, **asdict(self)}
        return json.dumps(data, indent=1) + "\n"


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of the shard set in ``directory``; ShardError naming what is wrong."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        if any(Path(directory).glob("*.tokens")):
            raise ShardError(
                f"{directory} holds shards but no {MANIFEST} (remake them: tools/make_shards.py)"
            )
        raise ShardError(f"no shards in {directory} (make some: python tools/make_shards.py {directory})")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ShardError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ShardError(f"{path} is not an {FORMAT} manifest (format {found!r})")
    try:
        return Manifest(
            tokenizer=TokenizerEntry(**data["tokenizer"]),
            dtype=str(data["dtype"]),
            shards=tuple(ShardEntry(**s) for s in data["shards"]),
            seed=int(data.get("seed", 0)),
            source=tuple(data.get("source", ())),
            validation_fraction=float(data.get("validation_fraction", 0.0)),
            documents={str(k): int(v) for k, v in (data.get("documents") or {}).items()},
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ShardError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from None


def write_manifest(directory: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically: readers see the old set or the new one, never half."""
    path = Path(directory) / MANIFEST
    partial = path.with_name(f".{MANIFEST}.partial")
    partial.write_text(manifest.to_json())
    os.replace(partial, path)
    return path


def tokenizer_entry(tokenizer: Tokenizer, directory: Path, *, origin: str) -> TokenizerEntry:
    """Store ``tokenizer`` in the shard folder (its tokenizer.json) and describe it."""
    text = tokenizer.to_json()
    if text is None:
        return TokenizerEntry(
            kind=tokenizer.kind, vocab_size=tokenizer.vocab_size, separator=tokenizer.separator, origin=origin
        )
    data = text.encode("utf-8")
    (directory / TOKENIZER_FILE).write_bytes(data)
    return TokenizerEntry(
        kind=tokenizer.kind,
        vocab_size=tokenizer.vocab_size,
        separator=tokenizer.separator,
        file=TOKENIZER_FILE,
        blake2b=digest(data),
        origin=origin,
    )


def load_tokenizer(directory: str | Path, entry: TokenizerEntry) -> Tokenizer:
    """The tokenizer that made the shards in ``directory``, checked against its digest."""
    if entry.kind == "bytes":
        return ByteTokenizer()
    path = Path(directory) / (entry.file or TOKENIZER_FILE)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{path} is missing: the manifest names it as the shards' tokenizer") from None
    if digest(data) != entry.blake2b:
        raise TokenizerError(
            f"{path} is not the tokenizer that made these shards (its BLAKE2b digest differs)"
        )
    tokenizer = JsonTokenizer(
        data.decode("utf-8"), kind=entry.kind, vocab_size=entry.vocab_size, origin=str(path)
    )
    if tokenizer.separator != entry.separator:
        raise TokenizerError(
            f"{path}: separator id {tokenizer.separator}, the manifest says {entry.separator}"
        )
    return tokenizer


def check_run_tokenizer(entry: TokenizerEntry, data: DataConfig, model_vocab: int, *, where: str) -> None:
    """TokenizerError unless the shards in ``where`` were made with the run's tokenizer and the
    run's model has a row for each of its ids: a run never mixes tokenizers."""
    made = f"the shards in {where} were made with {entry.describe()}"
    if entry.kind != data.tokenizer_kind:
        raise TokenizerError(f"{made}; the run's data.tokenizer is {data.tokenizer!r}")
    if entry.kind == "bpe" and entry.vocab_size != data.vocab_size:
        raise TokenizerError(f"{made}; the run's data.vocab_size is {data.vocab_size}")
    if entry.kind == "file":
        path = Path(data.tokenizer)
        try:
            mine = digest(path.read_bytes())
        except FileNotFoundError:
            raise TokenizerError(f"the run's tokenizer file {path} does not exist") from None
        if mine != entry.blake2b:
            raise TokenizerError(f"{made}; the run's {path} is another tokenizer (its digest differs)")
    if entry.vocab_size > model_vocab:
        raise TokenizerError(f"{made}; the run's model.vocab_size {model_vocab} has too few rows for its ids")


def tokenizer_record(entry: TokenizerEntry) -> str:
    """``entry`` as the JSON text an exported model carries (``ExportedModel.tokenizer``)."""
    return json.dumps(asdict(entry), sort_keys=True)


def check_model_tokenizer(record: str, entry: TokenizerEntry, *, model: str, where: str) -> None:
    """TokenizerError unless a model whose file records ``record`` was trained on shards of
    ``entry``'s tokenizer (a model exported without its shards records none: not checked)."""
    if not record:
        return
    try:
        theirs = TokenizerEntry(**json.loads(record))
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"{model}: its tokenizer record is unreadable ({exc})") from None
    fields = ("kind", "vocab_size", "separator", "blake2b")
    if any(getattr(theirs, f) != getattr(entry, f) for f in fields):
        raise TokenizerError(
            f"{model} was trained on shards of {theirs.describe()}; the shards in {where} were made "
            f"with {entry.describe()}"
        )
