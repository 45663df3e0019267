"""The operator of a local swarm: the identity ``tools/inject.py --run-dir`` acts with.

``swarm.py up`` creates the operator's key (RUN_DIR/keys/operator.key). In an authorized
swarm the swarm's authorizer issues it a credential of role ``operator``
(RUN_DIR/keys/operator.credential), which every node accepts as the run's operator; in an
open swarm, which has no authorizer, RUN_DIR/run.toml names the key in ``[operator]
public_keys`` and every node runs on that file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agora_core.admission.credential_file import save_credential
from agora_core.config import load_run_config
from agora_core.config.dump import dump_toml
from agora_core.identity import NodeKey
from agora_localswarm import authorizer


def key_file(run_dir: Path) -> Path:
    return run_dir / "keys" / "operator.key"


def credential_file(run_dir: Path) -> Path:
    return run_dir / "keys" / "operator.credential"


def prepare_operator(run_dir: Path, config: str, *, authorized: bool) -> str:
    """The swarm's operator key and what makes the nodes obey it; returns the run config every
    node runs on (``config`` itself in an authorized swarm: authorize() wrote it already)."""
    key = NodeKey.load_or_create(key_file(run_dir))
    if authorized:
        credential = authorizer.operator_credential(run_dir, config, key, "operator")
        credential_file(run_dir).unlink(missing_ok=True)
        save_credential(credential, credential_file(run_dir))
        return config
    credential_file(run_dir).unlink(missing_ok=True)  # an open run knows no credentials
    run = load_run_config(config)
    keys = list(dict.fromkeys([*run.operator.public_keys, key.public_key.hex()]))
    path = run_dir / "run.toml"
    path.write_text(
        dump_toml(dataclasses.replace(run, operator=dataclasses.replace(run.operator, public_keys=keys)))
    )
    return str(path)
