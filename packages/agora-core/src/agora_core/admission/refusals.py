"""Why the authorizer refuses a join or a refresh: one stable reason code per check.

The code travels to the joiner (and is stored with the request), so a contributor reads
what to fix and an operator counts refusals by reason (``agora-authorizer status``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RefusalReason(enum.StrEnum):
    # the request itself
    MALFORMED = "malformed"  # not a join request of this protocol
    BAD_SIGNATURE = "bad_signature"  # not signed by the key it names, or node id != key
    STALE = "stale"  # its timestamp is too far from the authorizer's clock
    REPLAYED = "replayed"  # its nonce was seen before
    OTHER_RUN = "other_run"  # it asks to join another run
    # capability
    DEVICE_MEMORY = "device_memory"
    HOST_MEMORY = "host_memory"
    DEVICE_NOT_ALLOWED = "device_not_allowed"  # not on the run's accelerator allow-list
    BANDWIDTH = "bandwidth"  # measured by the authorizer on the dial-back
    LATENCY = "latency"
    CHALLENGE_WRONG = "challenge_wrong"  # the compute challenge's result did not check out
    CHALLENGE_SLOW = "challenge_slow"
    # integrity
    SOFTWARE = "software"  # a package's version or source digest is not on the allowed list
    # reachability
    UNREACHABLE = "unreachable"  # the dial-back to the advertised address failed
    KEY_MISMATCH = "key_mismatch"  # the address answered, but not with the requesting key
    # accountability
    UNKNOWN_ACCOUNT = "unknown_account"  # no such account, or the token is wrong
    BANNED_ACCOUNT = "banned_account"
    BANNED_NODE = "banned_node"
    ACCOUNT_LIMIT = "account_limit"  # the account already has its most nodes in the run
    # placement and credentials
    NO_STAGE = "no_stage"  # a pin or request names a stage the run does not have
    EXPIRED = "expired"  # a refresh of a credential that already expired
    UNKNOWN_CREDENTIAL = "unknown_credential"  # a refresh of a credential it never issued
    REVOKED = "revoked"
    INTERRUPTED = "interrupted"  # the authorizer restarted while checking it: send it again


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refusal: the reason code and a sentence naming what was seen and what is needed."""

    reason: RefusalReason
    detail: str

    def to_value(self) -> dict:
        return {"status": "refused", "reason": self.reason.value, "detail": self.detail}
