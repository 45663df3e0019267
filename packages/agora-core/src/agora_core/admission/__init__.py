"""Admission: what a node sends the authorizer to join a run and what it gets back.

Every role builds or checks these, so they live in agora-core: the signed join request
(:mod:`.join_request`), the credential the authorizer signs (:mod:`.credential`), the compute
challenge (:mod:`.challenge`), the software report (:mod:`.software`), the refusal reasons
(:mod:`.refusals`) and the revocation list the authorizer publishes in the DHT
(:mod:`.revocations`). The authorizer itself is the ``agora-authorizer`` package.
"""

from agora_core.admission.credential import (
    Credential,
    CredentialError,
    SignedCredential,
    issue_credential,
    verify_credential,
)
from agora_core.admission.join_request import (
    HardwareReport,
    JoinRequest,
    RefreshRequest,
    SignedMessage,
    open_join_request,
    open_refresh_request,
    sign_join_request,
    sign_refresh_request,
)
from agora_core.admission.refusals import Refusal, RefusalReason

__all__ = [
    "Credential",
    "CredentialError",
    "HardwareReport",
    "JoinRequest",
    "RefreshRequest",
    "Refusal",
    "RefusalReason",
    "SignedCredential",
    "SignedMessage",
    "issue_credential",
    "open_join_request",
    "open_refresh_request",
    "sign_join_request",
    "sign_refresh_request",
    "verify_credential",
]
