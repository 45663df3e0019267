"""A run config written back as TOML reads back as the same config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agora_core.config import (
    AveragingConfig,
    ModelConfig,
    OptimizerConfig,
    RunConfig,
    load_run_config,
    parse_run_config,
)
from agora_core.config.dump import dump_toml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_survives_a_dump_and_parse(path):
    run = load_run_config(path)
    assert parse_run_config(dump_toml(run)) == run


def test_defaults_and_unusual_values_round_trip_exactly():
    run = RunConfig(
        name='odd "name"\\with\tescapes',
        seed=2**40,
        model=ModelConfig(kind="surrogate", mlp_ratio=1 / 3, stage_layers=(1, 0, 2)),
        averaging=AveragingConfig(reducers="listed", reducer_ids=("ab" * 20, 'c"d')),
        optimizer=OptimizerConfig(lr=1e-7, betas=(0.5, 0.999)),
    )
    for config in (RunConfig(), run):
        text = dump_toml(config)
        assert parse_run_config(text) == config
    assert parse_run_config(dump_toml(run)).model.mlp_ratio == 1 / 3  # floats are not rounded


def test_none_fields_are_left_out_and_read_back_as_none():
    text = dump_toml(RunConfig())
    assert "authorizer_public_key" not in text
    assert parse_run_config(text).admission.authorizer_public_key is None


def test_only_config_instances_are_written():
    with pytest.raises(TypeError, match="config dataclass instance"):
        dump_toml(RunConfig)

    @dataclasses.dataclass
    class Weird:
        value: object = dataclasses.field(default_factory=object)

    with pytest.raises(TypeError, match="value: cannot write a object"):
        dump_toml(Weird())
