"""An authorized run for tests and benchmarks: a throwaway authorizer key, the run config
naming it, credentials it signs, transport securities, and a real seed process.

The authorizer service (agora-authorizer) issues credentials from its database; tests of
agora-core's transport and DHT need none of that, only the key's signatures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

from agora_core import world
from agora_core.admission.credential import Credential, SignedCredential, issue_credential
from agora_core.admission.credential_file import save_credential
from agora_core.auth.peers import PeerVerifier
from agora_core.auth.security import TransportSecurity
from agora_core.config import RunConfig, parse_run_config
from agora_core.config.dump import dump_toml
from agora_core.identity import NodeKey
from agora_devkit.processes import spawn_python

SMALL_MODEL = '[model]\nkind = "surrogate"\nd_model = 64\nn_heads = 4\nstage_layers = [1, 1]\n'


@dataclasses.dataclass
class Seed:
    address: str
    key: NodeKey

    @property
    def bootstrap(self) -> str:
        """How other nodes name it in --bootstrap: ``<hex key>@address``."""
        return f"{self.key.public_key.hex()}@{self.address}"


class TestAuthority:
    """The authorizer key of a test run named ``run``, and what it signs."""

    __test__ = False  # not a pytest class

    def __init__(self, run: str = "auth-test", key: NodeKey | None = None, first_serial: int | None = None):
        self.run = run
        self.key = key or NodeKey.generate()
        if first_serial is None:  # far from a database's (a simulation passes its own: replayed)
            first_serial = 1 << 32 | int.from_bytes(os.urandom(4), "little")
        self._serials = itertools.count(first_serial)

    def run_config(self) -> RunConfig:
        """A small authorized run naming this key."""
        run = parse_run_config(f'name = "{self.run}"\n{SMALL_MODEL}')
        admission = dataclasses.replace(
            run.admission, mode="authorized", authorizer_public_key=self.key.public_key.hex()
        )
        return dataclasses.replace(run, admission=admission)

    def credential(
        self,
        key: NodeKey,
        *,
        run: str | None = None,
        lifetime_s: float = 600.0,
        role: str = "worker",
        stage: int | None = 0,
        account: str = "tests",
    ) -> SignedCredential:
        issued = world.wall()  # the simulator's clock in a simulated run
        fields = Credential(
            run=self.run if run is None else run,
            node_id=key.node_id,
            public_key=key.public_key,
            role=role,
            stage=stage,
            issued=issued,
            expires=issued + lifetime_s,
            serial=next(self._serials),
            account=account,
        )
        return issue_credential(self.key, fields)

    def security(self, key: NodeKey, held: SignedCredential | None, **options) -> TransportSecurity:
        """``key``'s transport security holding ``held`` (None: no credential)."""
        skew = options.pop("max_clock_skew_s", 10.0)
        verifier = PeerVerifier(run=self.run, authorizer_key=self.key.public_key, max_clock_skew_s=skew)
        value = None if held is None else held.to_value()
        return TransportSecurity(
            key=key, verifier=verifier, credential=lambda: value, max_clock_skew_s=skew, **options
        )

    @contextlib.contextmanager
    def seed_process(self, directory: Path, *bootstrap: str) -> Iterator[Seed]:
        """A real DHT node process of the run (``agora dht serve``) holding a credential of
        role dht, joined through ``bootstrap`` (none: the first member); always stopped."""
        directory.mkdir(parents=True, exist_ok=True)
        key = NodeKey.generate()
        key_file = key.save(directory / "seed.key")
        config = directory / "run.toml"
        config.write_text(dump_toml(self.run_config()))
        held = save_credential(self.credential(key, role="dht", stage=None), directory / "seed.credential")
        args = ["-m", "agora_core", "dht", "serve", "--config", str(config), "--key-file", str(key_file)]
        args += ["--credential", str(held), "--status-interval", "0.3", "--log-format", "json"]
        for address in bootstrap:
            args += ["--bootstrap", address]
        with spawn_python(args) as child:
            yield Seed(child.read_until("  serving    ", timeout_s=60), key)
