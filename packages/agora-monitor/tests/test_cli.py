"""What a user who got something wrong sees: one line naming it, no traceback."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from agora_monitor.cli import main


@pytest.fixture
def config(tmp_path, request):
    """examples/tiny.toml, giving up joining after 1 s."""
    text = (request.config.rootpath / "examples" / "tiny.toml").read_text()
    path = tmp_path / "run.toml"
    path.write_text(text.replace("[dht]\n", "[dht]\njoin_timeout_s = 1.0\n"))
    return path


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nobody listens once it closes


def serve(*args: str):
    return CliRunner().invoke(main, ["serve", *args])


def test_an_unreachable_bootstrap_is_one_clear_error(config, tmp_path):
    result = serve(
        "--config",
        str(config),
        "--bootstrap",
        f"127.0.0.1:{closed_port()}",
        "--db",
        str(tmp_path / "m.db"),
        "--http",
        "127.0.0.1:0",
    )
    assert result.exit_code == 1, result.output
    assert "error: could not join the run's DHT through" in result.output


def test_a_bad_db_url_and_a_bad_http_address_are_refused_before_joining(config, tmp_path):
    result = serve("--config", str(config), "--bootstrap", "127.0.0.1:1", "--db", "mysql://db/x")
    assert result.exit_code == 1 and "unsupported database" in result.output and "sqlite:///" in result.output
    result = serve("--config", str(config), "--bootstrap", "127.0.0.1:1", "--http", "localhost")
    assert result.exit_code == 2 and "--http" in result.output and "HOST:PORT" in result.output
    result = serve("--config", str(config), "--bootstrap", "127.0.0.1:1", "--period-s", "0")
    assert result.exit_code == 2 and "--period-s" in result.output


def test_an_authorized_run_without_a_credential_says_how_to_get_one(config, tmp_path):
    text = config.read_text()
    key = "00" * 32
    config.write_text(
        text.replace("[admission]\n", f'[admission]\nmode = "authorized"\nauthorizer_public_key = "{key}"\n')
    )
    result = serve(
        "--config",
        str(config),
        "--bootstrap",
        f"{key}@127.0.0.1:1",
        "--db",
        str(tmp_path / "m.db"),
        "--http",
        "127.0.0.1:0",
    )
    assert result.exit_code == 1, result.output
    assert (
        "needs a credential" in result.output
        and "agora-authorizer credential --role monitor" in result.output
    )


def test_every_flag_has_help():
    for command in main.commands.values():
        options = [p for p in command.params if p.param_type_name == "option"]
        assert options and [p.name for p in options if not p.help] == [], command.name
