"""Node settings of admission: the authorizer's address, the account and its token, and the
run config as the contract (an authorized run needs an authorizer, an open run has none)."""

from __future__ import annotations

import pytest

from agora_core.config import AdmissionConfig, NodeSettings
from agora_core.errors import ConfigError

KEY = "ab" * 32
AUTHORIZED = AdmissionConfig(mode="authorized", authorizer_public_key=KEY)


def test_admission_settings_come_from_agora_variables_and_flags_win():
    environ = {"AGORA_AUTHORIZER": "10.0.0.1:7000", "AGORA_ACCOUNT": "alice", "AGORA_ACCOUNT_TOKEN": "s3cret"}
    settings = NodeSettings.resolve({"account": "bob"}, environ=environ)
    assert (settings.authorizer, settings.account, settings.account_token) == (
        "10.0.0.1:7000",
        "bob",
        "s3cret",
    )
    assert "s3cret" not in repr(settings)  # logs and tracebacks do not show the token


def test_an_authorized_run_without_an_authorizer_is_refused_with_what_to_give():
    with pytest.raises(ConfigError) as info:
        NodeSettings().check_admission(AUTHORIZED)
    assert info.value.key == "authorizer"
    assert "--authorizer" in info.value.reason and "AGORA_ACCOUNT_TOKEN" in info.value.reason


def test_an_authorizer_given_to_an_open_run_is_refused():
    with pytest.raises(ConfigError) as info:
        NodeSettings(authorizer="127.0.0.1:7000").check_admission(AdmissionConfig())
    assert info.value.key == "authorizer" and "open" in info.value.reason


def test_matching_settings_pass():
    NodeSettings(authorizer="127.0.0.1:7000").check_admission(AUTHORIZED)
    NodeSettings().check_admission(AdmissionConfig())
