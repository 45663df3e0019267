"""``agora-authorizer credential``: issue a long-lived credential to a node the operator runs.

DHT seeds (role ``dht``), monitors and the operator's tools (``operator``) do not join through
the queue: the operator signs their credential offline, with the authorizer's key, recorded in
the authorizer's database like every other (its serial, and ``ban`` revokes it).
"""

from __future__ import annotations

import click

from agora_authorizer.store import Banned, Store
from agora_core import world
from agora_core.admission.credential import ROLES, Credential, issue_credential
from agora_core.admission.credential_file import save_credential
from agora_core.errors import AgoraError
from agora_core.identity import NodeKey
from agora_core.node.options import fail, load_config

OPERATOR_ACCOUNT = "operator"
DEFAULT_LIFETIME_S = 30 * 24 * 3600.0


def issue_operator_credential(
    store: Store, *, run, authorizer: NodeKey, node: NodeKey, role: str, stage: int | None, lifetime_s: float
):
    """Issue and record ``node``'s credential of ``role``; returns the signed credential."""
    issued = world.wall()
    signed = {}

    def sign(serial: int) -> tuple[bytes, bytes]:
        credential = Credential(
            run=run.name,
            node_id=node.node_id,
            public_key=node.public_key,
            role=role,
            stage=stage,
            issued=issued,
            expires=issued + lifetime_s,
            serial=serial,
            account=OPERATOR_ACCOUNT,
        )
        signed["credential"] = issue_credential(authorizer, credential)
        message = signed["credential"].message
        return message.body, message.signature

    store.issue_credential(
        request_id=None,
        node_id=node.node_id,
        public_key=node.public_key,
        role=role,
        stage=stage,
        account=OPERATOR_ACCOUNT,
        issued=issued,
        expires=issued + lifetime_s,
        sign=sign,
    )
    return signed["credential"]


def register(main: click.Group, db_option, open_store) -> None:
    @main.command()
    @click.option("--config", "config_file", required=True, type=click.Path(exists=True, dir_okay=False))
    @db_option
    @click.option("--node-key", required=True, help="The node's key file (created if missing).")
    @click.option("--role", type=click.Choice([r for r in ROLES if r != "worker"]), required=True)
    @click.option("--stage", type=int, help="The stage, for a role that has one.")
    @click.option("--lifetime-s", type=float, default=DEFAULT_LIFETIME_S, show_default=True)
    @click.option("--out", required=True, help="Where to write the credential (mode 0600).")
    def credential(config_file, db, key_file, node_key, role, stage, lifetime_s, out) -> None:
        """Issue a credential to a node the operator runs (a DHT seed, a monitor, a tool)."""
        run = load_config(config_file)
        try:
            authorizer = NodeKey.load(key_file)
            node = NodeKey.load_or_create(node_key)
        except AgoraError as exc:
            fail(str(exc))
        if authorizer.public_key.hex() != (run.admission.authorizer_public_key or "").lower():
            fail(f"{config_file}: [admission] authorizer_public_key is not the key in {key_file}")
        if lifetime_s <= 0:
            fail("--lifetime-s must be positive")
        store = open_store(db, key_file)
        try:
            signed = issue_operator_credential(
                store,
                run=run,
                authorizer=authorizer,
                node=node,
                role=role,
                stage=stage,
                lifetime_s=lifetime_s,
            )
        except Banned as exc:
            fail(str(exc), code=1)
        finally:
            store.close()
        path = save_credential(signed, out)
        click.echo(f"credential {signed.credential.serial} for node {node.node_id} ({role})")
        click.echo(f"  file       {path}")
        click.echo(f"  expires in {lifetime_s:g} s")
