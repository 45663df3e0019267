"""The monitor's seat in the run: a light member of its DHT that serves nothing but the DHT.

In an authorized run every member holds a credential; the monitor's is one the operator
issues offline (``agora-authorizer credential --role monitor``), given as ``--credential``
with the key it was issued for (``--key-file``). The role ``monitor`` is the one made for
this (``operator`` and ``dht`` work too: the DHT admits any credentialed role, and reading
records needs nothing more); a worker's or trainer's credential is refused, so a monitor
never passes for a node that does work.
"""

from __future__ import annotations

from collections.abc import Sequence

from agora_core.admission.credential_file import load_credential
from agora_core.config import RunConfig
from agora_core.dht import DhtError
from agora_core.errors import ConfigError
from agora_core.identity import NodeKey
from agora_core.node.role import RoleNode
from agora_core.node.run_node import RunNode
from agora_monitor.errors import BootstrapUnreachable, CredentialMissing

OBSERVER_ROLES = ("monitor", "operator", "dht")


def observer_node(
    run: RunConfig,
    *,
    key: NodeKey,
    bootstrap: Sequence[str],
    credential_file: str | None = None,
    listen: str = "127.0.0.1:0",
    advertise: str | None = None,
) -> RoleNode:
    """The monitor's member of ``run`` (not started); typed errors for a missing or wrong
    credential and for no bootstrap address."""
    if not bootstrap:
        raise ConfigError("--bootstrap", "give the address of a DHT member of the run to join through")
    credential = None
    if run.admission.authorized:
        if not credential_file:
            raise CredentialMissing(
                f"run {run.name!r} is authorized: the monitor needs a credential "
                "(agora-authorizer credential --role monitor --node-key KEY --out FILE; then "
                "--credential FILE --key-file KEY)"
            )
        credential = load_credential(
            credential_file,
            authorizer_public_key=run.admission.authorizer_key_bytes,
            run=run.name,
            public_key=key.public_key,
        )
        if credential.credential.role not in OBSERVER_ROLES:
            raise ConfigError(
                "--credential",
                f"{credential_file} is a {credential.credential.role}'s credential; a monitor "
                f"needs one of role {', '.join(OBSERVER_ROLES)}",
            )
    return RoleNode.build(
        "monitor", run, key, listen=listen, bootstrap=bootstrap, advertise=advertise, credential=credential
    )


async def join(node: RunNode, bootstrap: Sequence[str]) -> str:
    """Start ``node`` and join the DHT; BootstrapUnreachable when no bootstrap address answers
    within the run's dht.join_timeout_s (the node is stopped again then)."""
    try:
        return await node.start()
    except (DhtError, TimeoutError, OSError) as exc:
        await node.stop()
        raise BootstrapUnreachable(
            f"could not join the run's DHT through {', '.join(bootstrap)}: {exc}"
        ) from None
