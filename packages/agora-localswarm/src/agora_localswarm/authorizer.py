"""The authorizer of a local swarm: its key, the run config naming it, the swarm's account, pins.

``swarm.py up`` (unless ``--open``) runs its swarm the way a public run is run: it creates the
authorizer's key (``agora-authorizer keygen``), writes RUN_DIR/run.toml, the given config with
``[admission] mode = "authorized"``, that key and the swarm's account as a trust anchor
(``anchor_accounts``: its nodes accuse each on its own), opens that account for the swarm's
nodes (``account add swarm``; its token goes to RUN_DIR/keys/swarm.token, mode 0600, and reaches
the nodes as ``AGORA_ACCOUNT_TOKEN``), and serves admissions from RUN_DIR/authorizer.db. The
authorizer places the workers ``up`` starts; a worker added for a stage, or restarted on the
stage it served, is pinned there first (``agora-authorizer pin``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import click

from agora_core.admission.credential import SignedCredential
from agora_core.config import load_run_config
from agora_core.config.dump import dump_toml
from agora_core.identity import NodeKey

ACCOUNT = "swarm"  # the one account every node of a local swarm joins under
CLI_TIMEOUT_S = 60.0  # one agora-authorizer command (keygen, account add, pin, status)


def key_file(run_dir: Path) -> Path:
    return run_dir / "keys" / "authorizer.key"


def db_url(run_dir: Path) -> str:
    return str(run_dir / "authorizer.db")  # a file path: SQLite


def token_file(run_dir: Path) -> Path:
    return run_dir / "keys" / f"{ACCOUNT}.token"


def authorizer_cli(*args: str) -> str:
    """Run ``python -m agora_authorizer ARGS``; its stdout, or a ClickException with its error."""
    command = [sys.executable, "-m", "agora_authorizer", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise click.ClickException(
            f"agora-authorizer {args[0]} did not finish in {CLI_TIMEOUT_S:g} s"
        ) from None
    if done.returncode != 0:
        raise click.ClickException(
            f"agora-authorizer {' '.join(args[:2])}: {(done.stderr or done.stdout).strip()}"
        )
    return done.stdout


def value_after(output: str, prefix: str) -> str:
    """The rest of the first line of ``output`` that starts with ``prefix``."""
    for line in output.splitlines():
        if line.startswith(prefix):
            return line[len(prefix) :].strip()
    raise click.ClickException(f"agora-authorizer printed no {prefix.strip()!r} line:\n{output}")


def authorize(run_dir: Path, config: str) -> Path:
    """The authorizer's key (created if missing), RUN_DIR/run.toml naming it, a fresh database
    with the swarm's account; returns the path of run.toml."""
    public_key = value_after(authorizer_cli("keygen", "--key-file", str(key_file(run_dir))), "public key ")
    run = load_run_config(config)
    # The swarm's own nodes are the operator's: each is a witness on its own (a trust anchor).
    anchors = sorted({*run.admission.anchor_accounts, ACCOUNT})
    admission = dataclasses.replace(
        run.admission, mode="authorized", authorizer_public_key=public_key, anchor_accounts=anchors
    )
    path = run_dir / "run.toml"
    path.write_text(dump_toml(dataclasses.replace(run, admission=admission)))
    for old in run_dir.glob("authorizer.db*"):  # a fresh run: no admissions, pins or bans of the last
        old.unlink()
    output = authorizer_cli("account", "add", ACCOUNT, "--db", db_url(run_dir))
    token = token_file(run_dir)
    token.unlink(missing_ok=True)
    descriptor = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(value_after(output, "token "))
    return path


def serve_args(run_dir: Path, config: str, seed_address: str) -> list[str]:
    """The authorizer's command line: it joins the swarm's DHT (it publishes the revocation
    list there) and allows the agora packages installed here."""
    return [
        "-m",
        "agora_authorizer",
        "serve",
        *("--config", config, "--db", db_url(run_dir), "--key-file", str(key_file(run_dir))),
        *("--bootstrap", seed_address, "--allow-local-build"),
    ]


def operator_credential(run_dir: Path, config: str, key: NodeKey, role: str) -> SignedCredential:
    """A credential of ``role`` for ``key`` (the seed's, the status reader's), issued with
    the swarm's authorizer key and recorded in its database (in this process: no CLI)."""
    from agora_authorizer.cli_credential import DEFAULT_LIFETIME_S, issue_operator_credential
    from agora_authorizer.store import Store

    store = Store.open(db_url(run_dir))
    try:
        return issue_operator_credential(
            store,
            run=load_run_config(config),
            authorizer=NodeKey.load(key_file(run_dir)),
            node=key,
            role=role,
            stage=None,
            lifetime_s=DEFAULT_LIFETIME_S,
        )
    finally:
        store.close()


def node_flags(authorizer_address: str) -> list[str]:
    """What every worker and trainer of an authorized swarm is started with (and node_env)."""
    return ["--authorizer", authorizer_address, "--account", ACCOUNT]


def node_env(run_dir: Path) -> dict[str, str]:
    return {"AGORA_ACCOUNT_TOKEN": token_file(run_dir).read_text().strip()}


def pin(run_dir: Path, node_id: str, stage: int) -> None:
    """Place node ``node_id`` on ``stage`` when it next joins."""
    authorizer_cli("pin", node_id, str(stage), "--db", db_url(run_dir))


def admitted(run_dir: Path) -> dict | None:
    """The authorizer's ``admitted`` report (``by_role``, ``workers_per_stage``); None when
    its database cannot be read."""
    try:
        output = authorizer_cli("status", "--json", "--db", db_url(run_dir))
        return json.loads(output)["admitted"]
    except (click.ClickException, ValueError, KeyError):
        return None
