"""The tests' run config builder: the tiny surrogate run, overridden table by table."""

from __future__ import annotations

import pytest

from agora_core.config import parse_run_config
from agora_core.errors import ConfigError
from agora_devkit.runs import FAST_DHT, tiny_run, tiny_run_toml


def test_the_default_is_the_tiny_surrogate_on_a_fast_dht():
    run = tiny_run("t")
    assert run.name == "t" and run.model.kind == "surrogate" and run.model.stage_layers == (1, 1, 1)
    assert (run.model.d_model, run.model.n_heads, run.model.subspace_rank, run.model.vocab_size) == (
        32,
        2,
        4,
        256,
    )
    assert run.dht.gossip_period_s == FAST_DHT["gossip_period_s"]
    slow = tiny_run("t", fast_dht=False)
    assert slow.dht.gossip_period_s == parse_run_config('name = "t"').dht.gossip_period_s


def test_tables_keys_and_text_are_added_where_asked():
    run = tiny_run(
        "t",
        seed=9,
        stages=2,
        seq_len=16,
        dht={"op_timeout_s": 2.5},
        optimizer={"target_batch_size": 3},
        averaging={"reducers": "listed", "reducer_ids": ["ab"]},
        extra='[admission]\nmode = "open"',
        **{"model.surrogate": {"dummy_parameters": 7}},
    )
    assert run.seed == 9 and run.model.stage_layers == (1, 1) and run.model.seq_len == 16
    assert run.dht.op_timeout_s == 2.5 and run.dht.probe_timeout_s == FAST_DHT["probe_timeout_s"]
    assert run.optimizer.target_batch_size == 3 and run.averaging.reducer_ids == ("ab",)
    assert run.model.surrogate.dummy_parameters == 7 and run.admission.mode == "open"


def test_a_key_the_config_does_not_know_is_still_refused():
    with pytest.raises(ConfigError, match="no_such_key"):
        parse_run_config(tiny_run_toml("t", optimizer={"no_such_key": 1}))
