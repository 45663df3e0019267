"""Small run configs for tests: the tiny surrogate model they train, and a fast DHT.

``tiny_run_toml()`` writes the run config most tests share; each test adds or overrides the
tables it is about, by name (``optimizer={"target_batch_size": 8}``; a dotted name is a
sub-table: ``**{"model.surrogate": {"dummy_parameters": 16}}``). ``tiny_run()`` parses it.
"""

from __future__ import annotations

from typing import Any

from agora_core.config import RunConfig, parse_run_config
from agora_core.config.dump import toml_value

# A gossip cadence fast enough for tests to see joins and deaths within seconds.
FAST_DHT = {"gossip_period_s": 0.2, "probe_timeout_s": 0.1, "suspicion_timeout_s": 2.0}


def tiny_run_toml(
    name: str = "test",
    *,
    seed: int | None = None,
    seq_len: int = 8,
    stages: int = 3,
    fast_dht: bool = True,
    dht: dict[str, Any] | None = None,
    extra: str = "",
    **tables: dict[str, Any],
) -> str:
    """A run of the tiny surrogate model (d_model 32, 2 heads, subspace rank 4, 256 ids, one
    layer per stage, ``stages`` stages) on a fast DHT (``FAST_DHT`` unless ``fast_dht`` is
    false, updated by ``dht``). ``tables`` add or update tables by name; ``extra`` is TOML
    text appended as it is (a table a test builds as text)."""
    model = {
        "kind": "surrogate",
        "d_model": 32,
        "n_heads": 2,
        "subspace_rank": 4,
        "vocab_size": 256,
        "seq_len": seq_len,
        "stage_layers": [1] * stages,
    }
    merged: dict[str, dict[str, Any]] = {"model": model}
    if fast_dht or dht:
        merged["dht"] = {**(FAST_DHT if fast_dht else {}), **(dht or {})}
    for table, keys in tables.items():
        merged.setdefault(table, {}).update(keys)
    lines = [f"name = {toml_value(name)}"]
    if seed is not None:
        lines.append(f"seed = {seed}")
    for table, keys in merged.items():
        lines.append(f"[{table}]")
        lines += [f"{key} = {toml_value(value)}" for key, value in keys.items()]
    text = "\n".join(lines) + "\n"
    return text + extra.rstrip("\n") + "\n" if extra else text


def tiny_run(name: str = "test", **options: Any) -> RunConfig:
    """``tiny_run_toml(name, **options)``, parsed."""
    return parse_run_config(tiny_run_toml(name, **options))
