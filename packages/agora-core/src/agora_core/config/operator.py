"""The run config's ``[operator]`` section: who runs the run, as far as its nodes obey.

Failure injection (``agora_core.injection``) is the operator's: workers and trainers read the
run's injection records from the DHT and obey only those signed by an operator key. In an
open run (no authorizer) the keys listed here are the only operators. In an authorized run
the authorizer's own key and any key holding an authorizer-signed ``operator`` credential
are operators too, so operators can be added and banned without touching the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agora_core.config.admission import _is_hex_key
from agora_core.config.loader import require


@dataclass(kw_only=True, frozen=True)
class OperatorConfig:
    # Ed25519 public keys (64 hex digits each) whose injection records nodes obey, in any run.
    public_keys: list[str] = field(default_factory=list)
    # How often workers and trainers read the injection records (one DHT get each time);
    # 0: never (a run that takes no injections).
    injection_watch_s: float = 1.0

    def __post_init__(self) -> None:
        for key in self.public_keys:
            require(
                _is_hex_key(key),
                "public_keys",
                f"{key!r}: each entry is a 64-hex-digit Ed25519 public key (agora keygen prints one)",
            )
        require(self.injection_watch_s >= 0, "injection_watch_s", "must be >= 0 (0: no injections)")

    @property
    def key_bytes(self) -> frozenset[bytes]:
        return frozenset(bytes.fromhex(key) for key in self.public_keys)
