"""The run config: one TOML file every node of a run loads.

Defaults are the published Pluralis-8B run's values where the report states them (marked
"report"); the rest are conventional choices for a model of that size (marked "assumed").
``examples/`` holds small configs that run on a laptop CPU.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from agora_core.config.admission import AdmissionConfig
from agora_core.config.lifecycle import CheckpointConfig, JoinConfig, SyncConfig, TerminationConfig
from agora_core.config.loader import MiB, build, require
from agora_core.config.operator import OperatorConfig
from agora_core.config.unimplemented import refuse_not_implemented
from agora_core.errors import ConfigError


@dataclass(kw_only=True, frozen=True)
class SurrogateConfig:
    """Stand-ins for transformer stages in system tests (``model.kind = "surrogate"``)."""

    forward_delay_s: float = 0.0  # injected compute time per sample, forward
    backward_delay_s: float = 0.0  # injected compute time per sample, backward
    dummy_parameters: int = 0  # untrained parameters, to size the averaging payload
    fail_token: int = -1  # fault injection: a batch holding this token id fails in compute
    # Fault injection: a batch holding this token id computes NaN outputs, so its loss, its
    # input gradients and the stage's parameter gradients are NaN (-1: off).
    nan_token: int = -1

    def __post_init__(self) -> None:
        require(self.forward_delay_s >= 0, "forward_delay_s", "must be >= 0")
        require(self.backward_delay_s >= 0, "backward_delay_s", "must be >= 0")
        require(self.dummy_parameters >= 0, "dummy_parameters", "must be >= 0")


@dataclass(kw_only=True, frozen=True)
class ModelConfig:
    kind: Literal["transformer", "surrogate"] = "transformer"  # surrogate: linear test stages
    d_model: int = 5120  # report: d = 5120
    n_heads: int = 40  # assumed: 128-dim heads
    mlp_ratio: float = 3.0  # assumed; hidden = mlp_ratio * d_model
    subspace_rank: int = 51  # report: rank k ~ 51 for the residual subspace U_k
    vocab_size: int = 32000  # assumed
    seq_len: int = 2048  # assumed; tokens per sample
    # Transformer blocks per stage, head first and tail last. Report: 32 blocks in 7 stages,
    # 6 in the head and the tail, 4 in each body.
    stage_layers: tuple[int, ...] = (6, 4, 4, 4, 4, 4, 6)
    surrogate: SurrogateConfig = field(default_factory=SurrogateConfig)

    def __post_init__(self) -> None:
        require(self.d_model > 0, "d_model", "must be positive")
        require(self.n_heads > 0, "n_heads", "must be positive")
        require(
            self.d_model % self.n_heads == 0,
            "n_heads",
            f"must divide d_model ({self.d_model})",
        )
        require(self.mlp_ratio > 0, "mlp_ratio", "must be positive")
        require(
            0 < self.subspace_rank <= self.d_model,
            "subspace_rank",
            f"must lie in [1, d_model={self.d_model}]",
        )
        require(self.vocab_size > 0, "vocab_size", "must be positive")
        require(self.seq_len > 0, "seq_len", "must be positive")
        require(len(self.stage_layers) >= 2, "stage_layers", "needs at least a head and a tail")
        require(all(n >= 0 for n in self.stage_layers), "stage_layers", "layer counts must be >= 0")
        require(sum(self.stage_layers) > 0, "stage_layers", "the model needs at least one block")

    @property
    def n_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def n_layers(self) -> int:
        return sum(self.stage_layers)


BYTE_VOCAB = 256  # the byte tokenizer's ids: one per byte value
BPE_MIN_VOCAB = BYTE_VOCAB + 1  # a byte-level BPE holds every byte and the document separator


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    # What turns text into token ids; the shards' manifest records it and every node checks it:
    #   "bytes"  one token per UTF-8 byte (256 ids);
    #   "bpe"    a byte-level BPE of ``vocab_size`` ids that tools/make_shards.py trains on the
    #            run's corpus and stores with the shards (nothing downloaded);
    #   a path to a Hugging Face ``tokenizer.json`` (relative to the working directory).
    tokenizer: str = "bytes"
    vocab_size: int | None = None  # "bpe" only: the trained tokenizer's ids, separator included
    shuffle_seed: int = 0  # the order of shards in each epoch and of samples in each shard

    def __post_init__(self) -> None:
        require(
            self.tokenizer in ("bytes", "bpe") or self.tokenizer.endswith(".json"),
            "tokenizer",
            f'must be "bytes", "bpe" or the path of a tokenizer.json, got {self.tokenizer!r}',
        )
        if self.tokenizer == "bpe":
            require(
                self.vocab_size is not None and BPE_MIN_VOCAB <= self.vocab_size <= 1 << 20,
                "vocab_size",
                f'tokenizer = "bpe" needs vocab_size in [{BPE_MIN_VOCAB}, {1 << 20}] '
                "(256 bytes, the document separator, then merges)",
            )
        else:
            require(
                self.vocab_size is None,
                "vocab_size",
                f'applies to tokenizer = "bpe" only; {self.tokenizer!r} has a vocabulary of its own',
            )

    @property
    def tokenizer_kind(self) -> Literal["bytes", "bpe", "file"]:
        return "file" if self.tokenizer.endswith(".json") else self.tokenizer  # type: ignore[return-value]

    @property
    def known_vocab_size(self) -> int | None:
        """The tokenizer's ids where the config alone says (None for a tokenizer.json file)."""
        return {"bytes": BYTE_VOCAB, "bpe": self.vocab_size}.get(self.tokenizer)


STALE_GRADIENTS = ("drop", "apply")  # optimizer.stale_gradients


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    lr: float = 3.0e-4  # assumed peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 2000  # assumed
    total_steps: int = 100_000  # assumed; length of the cosine schedule
    betas: tuple[float, ...] = (0.9, 0.95)
    eps: float = 1.0e-8
    weight_decay: float = 0.1
    # Samples the stage's workers accumulate together before each takes its optimizer step.
    target_batch_size: int = 1024  # assumed
    # A worker refuses a step whose update (per weight, in learning rates) is more than this
    # many times its recent steps' median, and re-enters weight sync; 0 turns the guard off.
    max_update_ratio: float = 4.0
    # Weight copies a worker keeps so that a sample's backward recomputes its forward under the
    # weights that forward used (0: under the current ones, whatever they are by then).
    weight_versions: int = 2
    # A backward whose forward ran before this worker's last optimizer step (a sample in flight
    # across the step): "drop" passes its input gradient on but adds nothing to the weights'
    # gradient, "apply" adds it to the next step's. A gradient one step stale trains worse than
    # none (benchmarks/convergence.py, the delay ablation). The tail's backward is never stale.
    stale_gradients: str = "drop"

    def __post_init__(self) -> None:
        require(self.lr > 0, "lr", "must be positive")
        require(self.weight_versions >= 0, "weight_versions", "must be >= 0")
        require(
            self.stale_gradients in STALE_GRADIENTS, "stale_gradients", f"must be one of {STALE_GRADIENTS}"
        )
        require(
            self.max_update_ratio == 0 or self.max_update_ratio >= 1,
            "max_update_ratio",
            "must be 0 (off) or >= 1",
        )
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must lie in [0, 1]")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.total_steps > 0, "total_steps", "must be positive")
        require(len(self.betas) == 2, "betas", "must be [beta1, beta2]")
        require(all(0 <= b < 1 for b in self.betas), "betas", "each beta must lie in [0, 1)")
        require(self.eps > 0, "eps", "must be positive")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.target_batch_size > 0, "target_batch_size", "must be positive")


@dataclass(kw_only=True, frozen=True)
class ClippingConfig:
    # report: stage-wise clipping, a unit squared-norm budget split evenly over S stages
    # (threshold norm_budget / sqrt(S)), doubled for the tail.
    norm_budget: float = 1.0
    tail_factor: float = 2.0

    def __post_init__(self) -> None:
        require(self.norm_budget > 0, "norm_budget", "must be positive")
        require(self.tail_factor > 0, "tail_factor", "must be positive")

    def threshold(self, stage: int, n_stages: int) -> float:
        base = self.norm_budget / math.sqrt(n_stages)
        return base * self.tail_factor if stage == n_stages - 1 else base


@dataclass(kw_only=True, frozen=True)
class AveragingConfig:
    enabled: bool = True
    segments: int = 20  # report: 5% of the weights per round
    cadence_steps: int = 20  # report: one round every 20 optimizer steps
    matchmaking_window_s: float = 40.0  # report
    round_timeout_s: float = 150.0
    chunk_timeout_s: float = 30.0  # a sender missing this per-chunk deadline is banned
    # Chunk size, stream window and compression of the averaging streams: [transport]'s.
    # Who may reduce: "all" peers, or only the node ids listed in ``reducer_ids``.
    reducers: Literal["all", "listed"] = "all"
    reducer_ids: tuple[str, ...] = ()
    # Robustness to lying peers: a sender's chunk counts at most clip_multiplier times the
    # honest drift per value from the reducer's own copy (this round's lower median of the
    # other senders' with two or more, else that block's median over its last
    # clip_history_rounds visits), a reducer's difference at most as much at the sender (0:
    # off); a declared weight at most weight_ratio times the reducer's own (0: only the cap of
    # two rounds of the stage's samples).
    clip_multiplier: float = 4.0
    clip_history_rounds: int = 16
    weight_ratio: float = 4.0
    # A peer clipped here in accuse_after_rounds of this peer's last accuse_window_rounds
    # rounds is accused in the DHT, with the evidence (0: never accuse).
    accuse_after_rounds: int = 3
    accuse_window_rounds: int = 8
    # Keys older configs set here; an error says where they live now.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        "chunk_bytes": "transport.chunk_bytes",
        "window_chunks": "transport.stream_window",
        "compression": "transport.compression (true or false)",
    }

    def __post_init__(self) -> None:
        require(self.segments >= 1, "segments", "must be >= 1")
        require(self.cadence_steps >= 1, "cadence_steps", "must be >= 1")
        for name in ("matchmaking_window_s", "round_timeout_s", "chunk_timeout_s"):
            require(getattr(self, name) > 0, name, "must be positive")
        require(
            self.clip_multiplier == 0 or self.clip_multiplier >= 1,
            "clip_multiplier",
            "must be 0 (off) or >= 1",
        )
        require(self.clip_history_rounds >= 1, "clip_history_rounds", "must be >= 1")
        require(self.weight_ratio >= 0, "weight_ratio", "must be >= 0")
        require(self.accuse_after_rounds >= 0, "accuse_after_rounds", "must be >= 0 (0: never accuse)")
        require(
            self.accuse_window_rounds >= self.accuse_after_rounds,
            "accuse_window_rounds",
            f"must be >= accuse_after_rounds ({self.accuse_after_rounds})",
        )
        require(
            self.round_timeout_s > self.matchmaking_window_s,
            "round_timeout_s",
            f"must exceed matchmaking_window_s ({self.matchmaking_window_s})",
        )
        require(
            self.reducers != "listed" or bool(self.reducer_ids),
            "reducer_ids",
            'must name at least one node when reducers = "listed"',
        )


@dataclass(kw_only=True, frozen=True)
class DhtConfig:
    replication: int = 3  # R nodes closest to a key's hash hold it
    gossip_period_s: float = 1.0
    probe_timeout_s: float = 0.5
    indirect_probes: int = 3  # k peers asked to probe a silent node
    suspicion_timeout_s: float = 5.0
    # The lifetime of every entry a node publishes (announcements, progress, averaging):
    # owners refresh at least three times per lifetime; a dead node's entries vanish within it.
    record_ttl_s: float = 60.0
    max_expiration_ahead_s: float = 3600.0
    max_clock_skew_s: float = 30.0
    max_value_bytes: int = 64 * 1024
    max_subkeys: int = 4096
    op_timeout_s: float = 5.0  # a store/get waits this long for its replicas
    join_timeout_s: float = 30.0  # keep trying the bootstrap addresses this long
    sync_periods: int = 10  # every this many periods: membership and record anti-entropy
    tombstone_s: float = 60.0  # how long departed members are remembered (blocks stale gossip)
    piggyback_updates: int = 16  # membership updates carried per protocol message
    gossip_fanout: int = 3  # members news is pushed to, twice a period, while there is news

    def __post_init__(self) -> None:
        require(self.replication >= 1, "replication", "must be >= 1")
        require(self.indirect_probes >= 0, "indirect_probes", "must be >= 0")
        require(self.sync_periods >= 1, "sync_periods", "must be >= 1")
        require(self.piggyback_updates >= 1, "piggyback_updates", "must be >= 1")
        require(self.gossip_fanout >= 0, "gossip_fanout", "must be >= 0")
        for name in (
            "gossip_period_s",
            "probe_timeout_s",
            "suspicion_timeout_s",
            "record_ttl_s",
            "max_expiration_ahead_s",
            "max_clock_skew_s",
            "op_timeout_s",
            "join_timeout_s",
            "tombstone_s",
        ):
            require(getattr(self, name) > 0, name, "must be positive")
        require(
            self.probe_timeout_s < self.gossip_period_s,
            "probe_timeout_s",
            f"must be shorter than gossip_period_s ({self.gossip_period_s})",
        )
        require(
            self.record_ttl_s + self.max_clock_skew_s <= self.max_expiration_ahead_s,
            "record_ttl_s",
            f"plus max_clock_skew_s must not exceed max_expiration_ahead_s ({self.max_expiration_ahead_s:g}): "
            "replicas refuse entries that expire further ahead",
        )
        require(self.max_value_bytes > 0, "max_value_bytes", "must be positive")
        require(self.max_subkeys > 0, "max_subkeys", "must be positive")


@dataclass(kw_only=True, frozen=True)
class TransportConfig:
    # Tensors are cut into chunks of this size on the wire; averaging streams one chunk per
    # item. report: 16 Mbit chunks.
    chunk_bytes: int = 2 * MiB
    compression: bool = True  # LZ4 per chunk, only where it pays
    max_message_bytes: int = 512 * MiB
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    # Stream items in flight per stream, each way: a link's round trip's worth of averaging
    # chunks, few enough that a peer's returned differences and credits do not queue behind a
    # backlog of its own sends.
    stream_window: int = 4
    # The dtype of what crosses between stages: boundary payloads (B, T, k) and their
    # gradients. fp32: the receiver rebuilds the residual stream exactly; bf16: half the
    # inter-stage bytes, rebuilt to within bf16's rounding of the payload. Receivers take both.
    boundary_dtype: Literal["fp32", "bf16"] = "fp32"

    def __post_init__(self) -> None:
        require(4096 <= self.chunk_bytes <= 64 * MiB, "chunk_bytes", "must lie in [4 KiB, 64 MiB]")
        require(self.max_message_bytes >= self.chunk_bytes, "max_message_bytes", "must be >= chunk_bytes")
        require(self.request_timeout_s > 0, "request_timeout_s", "must be positive")
        require(self.connect_timeout_s > 0, "connect_timeout_s", "must be positive")
        require(self.stream_window >= 1, "stream_window", "must be >= 1")
        require(self.boundary_dtype in ("fp32", "bf16"), "boundary_dtype", 'must be "fp32" or "bf16"')


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    name: str = "agora"
    seed: int = 0  # derives the subspace basis, segment permutation and initial weights
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    clipping: ClippingConfig = field(default_factory=ClippingConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    join: JoinConfig = field(default_factory=JoinConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    termination: TerminationConfig = field(default_factory=TerminationConfig)
    dht: DhtConfig = field(default_factory=DhtConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    operator: OperatorConfig = field(default_factory=OperatorConfig)

    def __post_init__(self) -> None:
        require(bool(self.name) and len(self.name) <= 64, "name", "must be 1-64 characters")
        require(
            self.join.piece_bytes <= self.transport.max_message_bytes,
            "join.piece_bytes",
            "must not exceed transport.max_message_bytes",
        )
        departure_bound_s = self.dht.max_expiration_ahead_s - self.dht.max_clock_skew_s
        require(
            self.termination.departure_ttl_s <= departure_bound_s,
            "termination.departure_ttl_s",
            f"must not exceed dht.max_expiration_ahead_s - dht.max_clock_skew_s ({departure_bound_s:g} s):"
            " replicas refuse records that expire later",
        )
        require(
            self.dht.record_ttl_s > self.averaging.matchmaking_window_s,
            "dht.record_ttl_s",
            f"must exceed averaging.matchmaking_window_s ({self.averaging.matchmaking_window_s:g}): "
            "a peer's matchmaking entry must last through the window",
        )
        tokenizer_vocab = self.data.known_vocab_size
        require(
            tokenizer_vocab is None or self.model.vocab_size >= tokenizer_vocab,
            "model.vocab_size",
            f"must be >= the {self.data.tokenizer} tokenizer's {tokenizer_vocab} ids "
            "(every id needs an embedding and an LM-head row)",
        )


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a run config TOML file. Raises ConfigError naming the bad key."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("", f"run config {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path} is not valid TOML: {exc}") from None
    return _build_run(data)


def parse_run_config(text: str) -> RunConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"not valid TOML: {exc}") from None
    return _build_run(data)


def _build_run(data: dict) -> RunConfig:
    refuse_not_implemented(RunConfig, data)
    return build(RunConfig, data)
