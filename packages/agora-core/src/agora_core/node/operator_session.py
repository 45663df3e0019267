"""What every operator command does first: join a run's DHT as the operator, from flags or a run dir.

``agora inject`` and ``agora-trainer rotate-shards`` take the same flags: ``--run-dir`` (a local
swarm's: swarm.json, its run config, keys/operator.key and keys/operator.credential), or
``--bootstrap``, ``--config``, ``--key`` and in an authorized run ``--credential``. The tool is
one more member of the run's DHT for as long as a command takes, then leaves.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from agora_core.admission.credential import SignedCredential
from agora_core.admission.credential_file import load_credential
from agora_core.config import RunConfig, load_run_config
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics


@dataclass
class Operator:
    run: RunConfig
    bootstrap: list[str]
    key: NodeKey
    credential: SignedCredential | None

    async def node(self) -> RunNode:
        node = RunNode(
            run=self.run,
            key=self.key,
            metrics=NodeMetrics(role="operator", instance=self.key.node_id[:12]),
            bootstrap=self.bootstrap,
            credential=self.credential,
        )
        await node.start()
        return node

    def credential_value(self) -> Any:
        """The operator credential a record carries (None in an open run)."""
        return None if self.credential is None else self.credential.to_value()


def resolve(run_dir, bootstrap, config, key_file, credential_file) -> Operator:
    """The run, where to join it and the operator's identity: from the flags, falling back on
    a local swarm's run directory."""
    if run_dir is not None:
        swarm = json.loads((Path(run_dir) / "swarm.json").read_text())
        bootstrap = bootstrap or (swarm["seed_address"],)
        config = config or swarm["config"]
        keys = Path(run_dir) / "keys"
        key_file = key_file or keys / "operator.key"
        if credential_file is None and (keys / "operator.credential").exists():
            credential_file = keys / "operator.credential"
    if not bootstrap or not config or not key_file:
        raise click.UsageError("give --run-dir, or --bootstrap, --config and --key")
    run = load_run_config(config)
    key = NodeKey.load(key_file)
    credential = None
    if run.admission.authorized:
        if credential_file is None:
            raise click.UsageError(
                "an authorized run needs --credential (agora-authorizer credential --role operator)"
            )
        credential = load_credential(
            credential_file,
            authorizer_public_key=run.admission.authorizer_key_bytes,
            run=run.name,
            public_key=key.public_key,
        )
    return Operator(run, list(bootstrap), key, credential)


def operator_options(command):
    """The flags that say which run to join and as whom (see the module docstring)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def run_or_exit(coroutine: Coroutine, *errors: type[Exception]) -> None:
    """Run a command's coroutine; an expected error is one line on stderr and exit code 1."""
    try:
        asyncio.run(coroutine)
    except (AgoraError, OSError, *errors) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)


_OPTIONS = [
    click.option(
        "--run-dir",
        type=click.Path(file_okay=False, exists=True),
        help="A local swarm's run directory (tools/swarm.py up): bootstrap, config and keys from it.",
    ),
    click.option(
        "--bootstrap",
        multiple=True,
        help="A DHT member of the run (<hex key>@host:port in an authorized run).",
    ),
    click.option(
        "--config", type=click.Path(dir_okay=False, exists=True), help="The run config every node runs on."
    ),
    click.option(
        "--key", "key_file", type=click.Path(dir_okay=False, exists=True), help="The operator's key file."
    ),
    click.option(
        "--credential",
        "credential_file",
        type=click.Path(dir_okay=False, exists=True),
        help="Authorized run: the key's operator credential (agora-authorizer credential --role operator).",
    ),
]
