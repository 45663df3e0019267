"""An honest run config: every key is read by the code, or refused as not implemented yet.

The scan (``tools/config_reads.py``, whose docstring states what counts as a read) walks every
field of every config dataclass reachable from ``RunConfig`` and finds where the packages'
sources and ``tools/`` read it; the tests below hold the rule, check the scan's own rule on
small sources, and check that a config setting an unimplemented key is refused.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from agora_core.cli import main
from agora_core.config import AdmissionConfig, RunConfig, parse_run_config
from agora_core.config.unimplemented import NOT_IMPLEMENTED, field_at
from agora_core.errors import ConfigError
from agora_devkit import config_reads as tool

ROOT = Path(__file__).resolve().parents[3]


RUN_PY = tool.RUN_PY


@pytest.fixture(scope="module")
def reads() -> dict[tuple[str, str], list[str]]:
    return tool.scan(ROOT)


def scanned(source: str, path: str = "pkg/mod.py") -> set[tuple[str, str]]:
    scanner = tool.ReadScanner(tool.config_classes())
    scanner.scan(path, textwrap.dedent(source))
    return set(scanner.reads)


# --- the rule ---------------------------------------------------------------------------------------


def test_every_run_config_key_is_read_by_the_code_or_refused_as_not_implemented(reads):
    unread, _stale = tool.audit(reads)
    assert not unread, (
        f"read by nothing in packages/*/src or tools/: {', '.join(unread)}. Wire each one up, or list "
        "it in agora_core.config.unimplemented.NOT_IMPLEMENTED so a config that sets it is refused"
    )


def test_no_key_is_listed_as_not_implemented_while_the_code_reads_it(reads):
    missing = [key for key in NOT_IMPLEMENTED if key not in tool.leaf_keys()]
    assert not missing, f"NOT_IMPLEMENTED names keys the run config does not have: {missing}"
    _unread, stale = tool.audit(reads)
    assert not stale, f"implemented now, so remove them from NOT_IMPLEMENTED: {stale}"


def test_the_walk_reaches_nested_sections():
    keys = tool.leaf_keys()
    assert keys["model.surrogate.fail_token"] == ("SurrogateConfig", "fail_token")
    assert "model.surrogate" not in keys and keys["seed"] == ("RunConfig", "seed")
    assert {"AveragingConfig", "DhtConfig", "SurrogateConfig"} <= tool.config_classes().keys()


# --- what the scan counts as a read -----------------------------------------------------------------


def test_a_read_needs_a_receiver_known_to_hold_the_section():
    found = scanned(
        """
        def use(config: AveragingConfig, policy, message):
            config.enabled
            policy.enabled  # some other object's enabled
            message.kind

        def chained(run: RunConfig):
            run.model.surrogate.fail_token
        """
    )
    assert found == {
        ("AveragingConfig", "enabled"),
        ("RunConfig", "model"),
        ("ModelConfig", "surrogate"),
        ("SurrogateConfig", "fail_token"),
    }


def test_reads_through_attributes_aliases_getattr_and_the_run_convention():
    found = scanned(
        """
        class Owner:
            limits: DhtConfig

            def __init__(self, config: JoinConfig | None, run):
                self._config = config or JoinConfig()
                self._section = run.sync

            def use(self):
                m = self._section
                return self._config.attempts, m.stale_after_steps, getattr(self.limits, "max_subkeys")

        def tool():
            run = load_run_config("x.toml")
            return run.data.tokenizer
        """
    )
    assert {
        ("JoinConfig", "attempts"),
        ("SyncConfig", "stale_after_steps"),
        ("DhtConfig", "max_subkeys"),
    } <= found
    assert ("DataConfig", "tokenizer") in found  # ``run`` by convention (here also by load's name)


def test_validation_and_the_config_check_summary_are_not_uses():
    run_py = scanned(
        """
        @dataclass
        class DhtConfig:
            record_ttl_s: float = 60.0
            def __post_init__(self):
                require(self.record_ttl_s > 0, "record_ttl_s", "must be positive")
        """,
        path=RUN_PY,
    )
    cli = scanned(
        """
        def config_check(file):
            run = load_config(file)
            click.echo(run.admission.mode)
        """,
        path="packages/agora-core/src/agora_core/cli.py",
    )
    assert run_py == set() and ("AdmissionConfig", "mode") not in cli


def test_a_config_method_that_is_called_reads_the_fields_it_uses(reads):
    assert ("ClippingConfig", "threshold") in reads  # the worker's clip threshold
    assert any("via ClippingConfig.threshold" in where for where in reads[("ClippingConfig", "norm_budget")])
    assert any("via AdmissionConfig.authorized" in where for where in reads[("AdmissionConfig", "mode")])


# --- refusing what is not implemented ---------------------------------------------------------------


# Nothing is listed today (data.shuffle_seed, the last, came with shard rotation); the refusal
# is checked on a key registered for the test, as a key not implemented yet would be.
WHY = "trainers take samples in shard order (a test's registration)"


@pytest.fixture
def unimplemented(monkeypatch):
    monkeypatch.setitem(NOT_IMPLEMENTED, "data.shuffle_seed", WHY)
    return "data.shuffle_seed"


def test_every_registered_key_exists_and_its_default_loads(unimplemented):
    for key in NOT_IMPLEMENTED:
        field_at(RunConfig, key)  # raises for a key that is not in the run config
    assert parse_run_config("") == RunConfig()
    assert parse_run_config("[data]\nshuffle_seed = 0\n") == RunConfig()


def test_a_config_that_sets_an_unimplemented_key_is_refused_naming_it(unimplemented):
    with pytest.raises(ConfigError) as info:
        parse_run_config("[data]\nshuffle_seed = 7")
    assert info.value.key == unimplemented
    assert f"7 is not implemented yet: {WHY}" in str(info.value)


def test_an_implemented_key_is_taken():
    assert parse_run_config("[data]\nshuffle_seed = 7\n").data.shuffle_seed == 7


def test_an_unimplemented_key_with_a_wrong_type_gets_the_type_error(unimplemented):
    with pytest.raises(ConfigError, match="expected an integer") as info:
        parse_run_config('[data]\nshuffle_seed = "x"')
    assert info.value.key == unimplemented


def test_authorized_mode_still_validates_its_key_when_built_in_code():
    with pytest.raises(ConfigError) as info:
        AdmissionConfig(mode="authorized")
    assert info.value.key == "authorizer_public_key"


def test_config_check_lists_unimplemented_keys_and_refuses_a_config_setting_one(tmp_path, unimplemented):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text('name = "t"\n')
    bad.write_text("[data]\nshuffle_seed = 3\n")
    ok = CliRunner().invoke(main, ["config", "check", str(good)])
    assert ok.exit_code == 0, ok.output
    assert "not implemented yet" in ok.output
    assert all(key in ok.output for key in NOT_IMPLEMENTED)
    refused = CliRunner().invoke(main, ["config", "check", str(bad)])
    assert refused.exit_code != 0
    assert "data.shuffle_seed: 3 is not implemented yet" in refused.output
