"""The run config's ``[admission]`` section: who may join, and what the authorizer checks.

Defaults follow the published run where its report states them (marked "report"); a small
CPU run (examples/tiny.toml) lowers the hardware floors. A check whose threshold is 0 (or
whose list is empty) is off: each check is enabled on its own, as in the report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agora_core.config.loader import MiB, require

CHALLENGE_MAX_WIDTH = 1 << 14  # agora_core.admission.challenge.MAX_WIDTH: exact in float32 far beyond


def _is_hex_key(value: str | None) -> bool:
    return value is not None and len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value)


@dataclass(kw_only=True, frozen=True)
class AdmissionConfig:
    # open: no authorizer, anyone who can reach a port joins (a private experiment on one
    # machine). authorized: a node needs a credential from the authorizer whose Ed25519
    # public key (hex) is named here.
    mode: Literal["open", "authorized"] = "open"
    authorizer_public_key: str | None = None
    # --- credentials --------------------------------------------------------------------
    credential_lifetime_s: float = 600.0  # refreshed at two thirds of it
    request_max_age_s: float = 60.0  # a request whose timestamp is further off is stale
    # how far two nodes' clocks may disagree: a peer whose greeting's time is further off
    # is refused (fix its clock), and credentials are valid this much either side of their life
    max_clock_skew_s: float = 10.0
    # --- the queue: a token bucket releases queued nodes in arrival order -----------------
    admissions_per_minute: float = 30.0  # 0: no rate limit
    admission_burst: int = 4  # admissions the bucket holds when idle
    # --- capability (workers); report: 24 GB VRAM, 80 GB RAM, 200 Mbit/s, <= 80 ms --------
    min_device_memory_gb: float = 24.0
    min_host_memory_gb: float = 80.0
    allowed_devices: list[str] = field(default_factory=list)  # device names; empty: any
    min_bandwidth_mbps: float = 200.0  # measured by the authorizer on the dial-back
    max_latency_ms: float = 80.0  # round trip of the dial-back; 0: no limit
    bandwidth_probe_bytes: int = 4 * MiB  # sent by the joiner for the bandwidth measurement
    challenge_width: int = 0  # the compute challenge's matmul width; 0: the model's d_model
    challenge_rows_checked: int = 4  # rows of the product the authorizer recomputes
    max_challenge_s: float = 10.0  # the challenge's round trip; 0: no limit
    # --- integrity: "<distribution> <version> <sha256 of its sources>" (digest "*": any) --
    # Empty: the check is off, unless the authorizer is started with --allow-local-build.
    allowed_software: list[str] = field(default_factory=list)
    # --- accountability ---------------------------------------------------------------------
    max_nodes_per_account: int = 64  # admitted nodes with a live credential, per account
    # --- accusations (agora_core.admission.accusations) --------------------------------------
    # The authorizer revokes a node accused by this many independent accusers: with live
    # credentials (a worker only on the accused's stage), one per account, except that every
    # node of an anchor account counts on its own. Never 1, so no single node can get an
    # honest one banned; 0: accusations are only listed.
    revoke_after_accusers: int = 2
    # Trust anchors: the accounts of the nodes the operator runs itself.
    anchor_accounts: list[str] = field(default_factory=list)
    # A trainer of an anchor account whose spot checks caught a worker (its output stood
    # apart from two replicas that agreed, twice) gets it revoked on its own: the operator's
    # trainer does not lie about what it saw.
    revoke_on_anchor_spot_check: bool = True

    def __post_init__(self) -> None:
        if self.mode == "authorized" or self.authorizer_public_key is not None:
            require(
                _is_hex_key(self.authorizer_public_key),
                "authorizer_public_key",
                'mode "authorized" needs the authorizer\'s 64-hex-digit Ed25519 public key '
                "(agora-authorizer keygen prints it)",
            )
        for name in ("credential_lifetime_s", "request_max_age_s", "max_clock_skew_s"):
            require(getattr(self, name) > 0, name, "must be positive")
        for name in (
            "admissions_per_minute",
            "min_device_memory_gb",
            "min_host_memory_gb",
            "min_bandwidth_mbps",
            "max_latency_ms",
            "max_challenge_s",
        ):
            require(getattr(self, name) >= 0, name, "must be >= 0")
        require(self.admission_burst >= 1, "admission_burst", "must be >= 1")
        require(self.bandwidth_probe_bytes >= 0, "bandwidth_probe_bytes", "must be >= 0")
        require(
            0 <= self.challenge_width <= CHALLENGE_MAX_WIDTH,
            "challenge_width",
            f"must lie in [0, {CHALLENGE_MAX_WIDTH}] (0: the model's d_model)",
        )
        require(self.challenge_rows_checked >= 1, "challenge_rows_checked", "must be >= 1")
        require(self.max_nodes_per_account >= 1, "max_nodes_per_account", "must be >= 1")
        require(
            self.revoke_after_accusers == 0 or self.revoke_after_accusers >= 2,
            "revoke_after_accusers",
            "must be 0 (never revoke) or >= 2: one accuser alone must not get a node banned",
        )
        for entry in self.allowed_software:
            require(
                len(entry.split()) == 3,
                "allowed_software",
                f"{entry!r}: each entry is '<distribution> <version> <digest>' (agora-authorizer software)",
            )

    def challenge_width_for(self, d_model: int) -> int:
        """The compute challenge's matmul width for a model of width ``d_model``."""
        return min(self.challenge_width or d_model, CHALLENGE_MAX_WIDTH)

    @property
    def authorized(self) -> bool:
        return self.mode == "authorized"

    @property
    def authorizer_key_bytes(self) -> bytes | None:
        return bytes.fromhex(self.authorizer_public_key) if self.authorizer_public_key else None
