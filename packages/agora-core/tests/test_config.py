"""Run config and node settings: defaults, validation errors that name the key, precedence."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from agora_core.config import NodeSettings, RunConfig, load_run_config, parse_run_config
from agora_core.errors import ConfigError
from agora_core.node.run_node import rpc_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


def test_defaults_are_the_published_runs_values():
    run = RunConfig()
    assert run.model.stage_layers == (6, 4, 4, 4, 4, 4, 6) and run.model.n_layers == 32
    assert run.averaging.segments == 20 and run.averaging.cadence_steps == 20
    assert run.averaging.matchmaking_window_s == 40.0
    assert (run.sync.weight_sync_steps, run.sync.optimizer_sync_steps) == (400, 100)
    assert run.clipping.threshold(0, 7) == pytest.approx(1 / math.sqrt(7))
    assert run.clipping.threshold(6, 7) == pytest.approx(2 / math.sqrt(7))
    term = run.termination  # report: two failed rounds of the last three; a host RAM limit is opt-in
    assert (term.failed_rounds, term.rounds_window, term.max_host_rss_mib) == (2, 3, 0)
    assert (term.compute_failures, term.nonfinite_steps) == (3, 1)


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_loads(path):
    run = load_run_config(path)
    assert run.model.n_stages >= 2


def test_values_override_defaults_and_lists_become_tuples():
    run = parse_run_config('seed = 7\n[model]\nstage_layers = [2, 2]\n[averaging]\nreducer_ids = ["a"]\n')
    assert run.seed == 7 and run.model.stage_layers == (2, 2)
    assert run.averaging.reducer_ids == ("a",) and run.averaging.segments == 20


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("[averaging]\nsegmnts = 3", "averaging.segmnts", "did you mean 'segments'"),
        ("[averaging]\nsegments = 0", "averaging.segments", ">= 1"),
        ("[averaging]\nsegments = 2.5", "averaging.segments", "integer"),
        ("[model]\nn_heads = 7", "model.n_heads", "must divide d_model"),
        ('[model]\nstage_layers = [1, "x"]', "model.stage_layers[1]", "integer"),
        ('[model]\nkind = "rnn"', "model.kind", "one of"),
        ("[dht]\nreplication = true", "dht.replication", "integer"),
        ("[dht]\nprobe_timeout_s = 5.0", "dht.probe_timeout_s", "shorter than gossip_period_s"),
        ("[dht]\nrecord_ttl_s = 30.0", "dht.record_ttl_s", "exceed averaging.matchmaking_window_s"),
        ("[dht]\nrecord_ttl_s = 3580.0", "dht.record_ttl_s", "max_expiration_ahead_s"),
        ('[admission]\nmode = "authorized"', "admission.authorizer_public_key", "64-hex-digit"),
        ("[admission]\nadmission_burst = 0", "admission.admission_burst", ">= 1"),
        ('[admission]\nallowed_software = ["agora-core 0.1"]', "admission.allowed_software", "<digest>"),
        ("model = 3", "model", "expected a table"),
        ("[model]\nvocab_size = 100", "model.vocab_size", "bytes tokenizer's 256 ids"),
        (
            '[data]\ntokenizer = "gpt2"',
            "data.tokenizer",
            'must be "bytes", "bpe" or the path of a tokenizer.json',
        ),
        ('[data]\ntokenizer = "bpe"', "data.vocab_size", 'tokenizer = "bpe" needs vocab_size in [257,'),
        ("[data]\nvocab_size = 300", "data.vocab_size", 'applies to tokenizer = "bpe" only'),
        (
            '[model]\nvocab_size = 512\n[data]\ntokenizer = "bpe"\nvocab_size = 1024',
            "model.vocab_size",
            "bpe tokenizer's 1024 ids",
        ),
        ("colour = 1", "colour", "unknown key"),
        ("[termination]\nunreachable = 5", "termination.unreachable", "did you mean 'unreachable_s'"),
        ("[termination]\nfailed_rounds = 4", "termination.failed_rounds", "rounds_window (3)"),
        ("[termination]\nno_progress_s = -1", "termination.no_progress_s", "0: the rule is off"),
        ("[termination]\ndeparture_ttl_s = 3590", "termination.departure_ttl_s", "max_clock_skew_s (3570 s)"),
    ],
)
def test_errors_name_the_key_and_the_reason(text, key, reason):
    with pytest.raises(ConfigError) as info:
        parse_run_config(text)
    assert info.value.key == key
    assert reason in str(info.value)


def test_a_key_that_moved_names_its_new_place():
    with pytest.raises(ConfigError) as info:
        parse_run_config("[averaging]\nchunk_bytes = 65536\n")
    assert info.value.key == "averaging.chunk_bytes" and "transport.chunk_bytes" in info.value.reason


def test_files_that_are_missing_or_not_toml_get_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_run_config(bad)


def test_node_settings_precedence_defaults_env_flags():
    env = {"AGORA_METRICS_PORT": "9100", "AGORA_LISTEN": "127.0.0.1:7000", "AGORA_LOG_FORMAT": "json"}
    settings = NodeSettings.resolve({"listen": "127.0.0.1:7001", "metrics_port": None}, environ=env)
    assert settings.listen == "127.0.0.1:7001"  # flag beats env
    assert settings.metrics_port == 9100  # env beats default; a None flag is "not given"
    assert settings.log_format == "json"
    assert settings.log_level == "info"  # default


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"AGORA_METRICS_PORT": "lots"}, "AGORA_METRICS_PORT"),
        ({"AGORA_METRICS_PORT": "70000"}, "metrics_port"),
        ({"AGORA_LISTEN": "nowhere"}, "listen"),
        ({"AGORA_LINK": "up=fast"}, "link"),
        ({"AGORA_LOG_LEVEL": "loud"}, "AGORA_LOG_LEVEL"),
    ],
)
def test_bad_node_settings_name_the_variable(env, key):
    with pytest.raises(ConfigError) as info:
        NodeSettings.resolve(environ=env)
    assert info.value.key == key


def test_link_setting_parses_into_a_link_config():
    settings = NodeSettings.resolve(environ={"AGORA_LINK": "up=100M,latency=20ms"})
    assert settings.link_config.up_bits_per_s == 100e6
    assert settings.link_config.latency_s == pytest.approx(0.02)


def test_transport_section_configures_the_rpc_layer():
    run = parse_run_config("[transport]\nchunk_bytes = 65536\ncompression = false\nstream_window = 3\n")
    rpc = rpc_config(run.transport, max_inflight_requests=7)
    assert rpc.wire.chunk_bytes == 65536 and not rpc.wire.compression.enabled
    assert rpc.stream_window == 3 and rpc.max_inflight_requests == 7
    assert rpc.wire.limits.max_message_bytes == run.transport.max_message_bytes
