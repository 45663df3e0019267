"""A worker in an authorized run: placed and admitted by a real authorizer process, stopped when
its credential is lost; and the command line's rules on --stage and --authorizer."""

from __future__ import annotations

import subprocess
import sys

import pytest

KEY = "ab" * 32
RUN = (
    'name = "{name}"\n[model]\nkind = "surrogate"\nd_model = 32\nn_heads = 2\nsubspace_rank = 4\n'
    "seq_len = 8\nstage_layers = [1, 1]\n[dht]\ngossip_period_s = 0.2\nprobe_timeout_s = 0.1\n"
    "[admission]\n{admission}\n"
)
CLI_S = 60  # one worker command that exits at once (it imports torch first)


def worker_cli(tmp_path, admission: str, *flags: str) -> subprocess.CompletedProcess:
    config = tmp_path / "run.toml"
    config.write_text(RUN.format(name="cli", admission=admission))
    command = [
        sys.executable,
        "-m",
        "agora_worker",
        "run",
        "--config",
        str(config),
        "--key-file",
        str(tmp_path / "k"),
    ]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=CLI_S)


@pytest.mark.parametrize(
    ("admission", "flags", "says"),
    [
        # the authorizer places workers: --stage is not the worker's to choose
        (
            f'mode = "authorized"\nauthorizer_public_key = "{KEY}"',
            ("--authorizer", "127.0.0.1:9", "--stage", "1"),
            "agora-authorizer pin",
        ),
        # an open run has nobody to place it
        ('mode = "open"', (), "--stage is required"),
        # the run config is the contract: no authorizer for an authorized run, none for an open one
        (f'mode = "authorized"\nauthorizer_public_key = "{KEY}"', (), "--authorizer HOST:PORT"),
        ('mode = "open"', ("--stage", "0", "--authorizer", "127.0.0.1:9"), "an open run has no authorizer"),
    ],
)
def test_the_command_line_refuses_a_stage_or_an_authorizer_the_run_config_does_not_call_for(
    tmp_path, admission, flags, says
):
    done = worker_cli(tmp_path, admission, *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr, done.stderr
