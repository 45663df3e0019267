"""Who may order a failure: the run's operator keys, as every node checks them locally.

"The run's operator key" is decided by the run config, and by the authorizer in an
authorized run:

* ``[operator] public_keys`` lists keys whose records every node obeys, in any run. An open
  run has no other root of trust, so this list is its only way to name an operator (a run
  that lists none takes no injections).
* In an authorized run the authorizer is the root of trust already: its own key is an
  operator, and so is any key holding an authorizer-signed credential of role ``operator``
  (``agora-authorizer credential --role operator``), carried inside the record. Operators
  are then added without touching the config every node already runs, expire with their
  credential, and are banned like any node (the revocation list). The credential travels in
  the record, not through the DHT's member table, because the tool that wrote it has usually
  left the DHT by the time nodes read it.

The record's writer is the key that signed the DHT record (checked by every replica and by
the reader); its subkey is owned by that key, so no one else can write, replace or delete it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agora_core.admission.credential import CredentialError
from agora_core.config.operator import OperatorConfig
from agora_core.injection.record import Injection, InjectionRejected, record_subkey

if TYPE_CHECKING:
    from agora_core.auth.peers import PeerVerifier
    from agora_core.dht import DhtValue

OPERATOR_ROLE = "operator"


class OperatorKeys:
    """The checks that decide whether a record's writer may order injections in this run."""

    def __init__(self, config: OperatorConfig, verifier: PeerVerifier | None = None):
        """``verifier``: an authorized run's credential checks (None in an open run)."""
        self._keys = config.key_bytes
        self._verifier = verifier

    def check(self, subkey: str, found: DhtValue, injection: Injection) -> None:
        """InjectionRejected (``unsigned``, ``malformed``, ``not_operator``) unless an operator
        wrote this record under its own subkey for the record's id."""
        self.check_record(subkey, found, injection.id, injection.credential)

    def check_record(self, subkey: str, found: DhtValue, record_id: str, credential: Any) -> None:
        """The same for any operator record (injections, shard assignments): ``found`` signed by
        an operator, under the writer's own subkey for ``record_id``; ``credential`` the one
        the record carries (an authorized run's operator credential, or None)."""
        writer = found.writer
        if writer is None:
            raise InjectionRejected("unsigned", "an unsigned record orders nothing")
        if found.owner != writer or subkey != record_subkey(writer, record_id):
            raise InjectionRejected("malformed", "a record lives under its writer's subkey for its id")
        if writer in self._keys:
            return
        verifier = self._verifier
        if verifier is None:
            raise InjectionRejected("not_operator", "the writer is not listed in [operator] public_keys")
        if writer == verifier.authorizer_key:
            return
        if credential is None:
            raise InjectionRejected(
                "not_operator", "the writer is not an operator: no credential in the record"
            )
        try:
            identity = verifier.identify(writer, credential)
        except CredentialError as exc:
            raise InjectionRejected("not_operator", f"the writer's credential: {exc}") from None
        if identity.role != OPERATOR_ROLE:
            raise InjectionRejected("not_operator", f"the writer's credential is a {identity.role}'s")
