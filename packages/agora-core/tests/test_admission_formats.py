"""The admission formats every node checks: credentials, join and refresh requests, the
compute challenge, software digests and the revocation list's validator."""

from __future__ import annotations

import time

import numpy as np
import pytest

from agora_core.admission import (
    Credential,
    CredentialError,
    HardwareReport,
    JoinRequest,
    RefreshRequest,
    RefusalReason,
    issue_credential,
    open_join_request,
    open_refresh_request,
    sign_join_request,
    sign_refresh_request,
    verify_credential,
)
from agora_core.admission.challenge import answer_challenge, check_rows
from agora_core.admission.revocations import Revocations, check_revocations
from agora_core.admission.software import parse_allowed, source_digest
from agora_core.dht.records import RecordRejected, owned_subkey
from agora_core.identity import NodeKey

AUTHORIZER = NodeKey.generate()


def credential_for(node: NodeKey, *, run="r", issued=None, lifetime=600.0) -> Credential:
    issued = time.time() if issued is None else issued
    return Credential(
        run=run,
        node_id=node.node_id,
        public_key=node.public_key,
        role="worker",
        stage=1,
        issued=issued,
        expires=issued + lifetime,
        serial=7,
    )


def test_a_credential_checks_only_with_the_authorizer_key_run_time_and_holder():
    node = NodeKey.generate()
    signed = issue_credential(AUTHORIZER, credential_for(node)).to_value()
    ok = verify_credential(
        signed, authorizer_public_key=AUTHORIZER.public_key, run="r", public_key=node.public_key
    )
    assert ok.credential.stage == 1 and ok.credential.serial == 7
    cases = {
        "bad_signature": dict(authorizer_public_key=NodeKey.generate().public_key, run="r"),
        "other_run": dict(authorizer_public_key=AUTHORIZER.public_key, run="s"),
        "expired": dict(authorizer_public_key=AUTHORIZER.public_key, run="r", now=time.time() + 700),
        "not_yet_valid": dict(authorizer_public_key=AUTHORIZER.public_key, run="r", now=time.time() - 60),
        "wrong_key": dict(
            authorizer_public_key=AUTHORIZER.public_key, run="r", public_key=NodeKey.generate().public_key
        ),
    }
    for reason, kwargs in cases.items():
        with pytest.raises(CredentialError) as info:
            verify_credential(signed, **kwargs)
        assert info.value.reason == reason
    tampered = {**signed, "body": signed["body"].replace(b"worker", b"monitr")}
    with pytest.raises(CredentialError) as info:
        verify_credential(tampered, authorizer_public_key=AUTHORIZER.public_key, run="r")
    assert info.value.reason == "bad_signature"
    with pytest.raises(CredentialError) as info:
        verify_credential({"body": 3}, authorizer_public_key=AUTHORIZER.public_key, run="r")
    assert info.value.reason == "malformed"


def join_request(node: NodeKey, **overrides) -> JoinRequest:
    fields = dict(
        run="r",
        node_id=node.node_id,
        public_key=node.public_key,
        role="worker",
        address="tcp://127.0.0.1:1",
        account="a",
        account_token="t",
        hardware=HardwareReport(device="cpu"),
        software={},
    )
    return JoinRequest(**{**fields, **overrides})


def test_a_join_request_opens_only_when_signed_by_its_own_key_for_this_run_and_fresh():
    node = NodeKey.generate()
    now = time.time()
    opened = open_join_request(
        sign_join_request(node, join_request(node)).to_value(), run="r", now=now, max_age_s=60
    )
    assert isinstance(opened, JoinRequest) and opened.node_id == node.node_id
    other = NodeKey.generate()
    refusals = {
        RefusalReason.BAD_SIGNATURE: sign_join_request(other, join_request(node)),  # signed by another key
        RefusalReason.OTHER_RUN: sign_join_request(node, join_request(node, run="s")),
        RefusalReason.STALE: sign_join_request(node, join_request(node, timestamp=now - 3600)),
        RefusalReason.MALFORMED: sign_join_request(node, join_request(node, role="king")),
    }
    for reason, signed in refusals.items():
        refusal = open_join_request(signed.to_value(), run="r", now=now, max_age_s=60)
        assert getattr(refusal, "reason", None) is reason, (reason, refusal)
    # a node id that is not its key's hash
    spoofed = sign_join_request(node, join_request(node, node_id=other.node_id))
    assert (
        open_join_request(spoofed.to_value(), run="r", now=now, max_age_s=60).reason
        is RefusalReason.BAD_SIGNATURE
    )
    assert open_join_request(b"junk", run="r", now=now, max_age_s=60).reason is RefusalReason.MALFORMED


def test_a_refresh_opens_only_when_signed_by_the_credentials_key():
    node = NodeKey.generate()
    signed = sign_refresh_request(node, RefreshRequest(run="r", node_id=node.node_id, serial=3)).to_value()
    now = time.time()
    opened = open_refresh_request(
        signed, public_key_of={3: node.public_key}.get, run="r", now=now, max_age_s=60
    )
    assert isinstance(opened, RefreshRequest) and opened.serial == 3
    stolen = open_refresh_request(
        signed, public_key_of={3: NodeKey.generate().public_key}.get, run="r", now=now, max_age_s=60
    )
    assert stolen.reason is RefusalReason.BAD_SIGNATURE
    unknown = open_refresh_request(signed, public_key_of={}.get, run="r", now=now, max_age_s=60)
    assert unknown.reason is RefusalReason.UNKNOWN_CREDENTIAL


def test_the_challenge_is_exact_and_a_wrong_row_is_caught():
    answer = answer_challenge(11, 48)
    assert check_rows(11, 48, answer, list(range(48)))
    assert answer_challenge(11, 48, lambda a, b: (a.astype(np.float64) @ b).astype(np.float32)) == answer
    broken = bytearray(answer)
    broken[5 * 8] ^= 1  # row 5 wrong
    assert not check_rows(11, 48, bytes(broken), [5]) and check_rows(11, 48, bytes(broken), [4, 6])
    assert not check_rows(12, 48, answer, [0, 1, 2])  # another seed
    assert not check_rows(11, 48, answer[:-8], [0])


def test_a_source_digest_changes_with_any_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = source_digest(tmp_path)
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert source_digest(tmp_path) != first
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    assert source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "b.py")
    assert source_digest(tmp_path) != first
    assert parse_allowed(["agora-core 0.1.0 abc", "agora-core 0.1.1 *"]) == {
        "agora-core": {("0.1.0", "abc"), ("0.1.1", "*")}
    }


def test_only_the_authorizer_may_write_the_revocation_list():
    check = check_revocations(AUTHORIZER.public_key)
    value = Revocations(nodes=("n",), accounts=("a",), updated=1.0).to_value()
    check("r/revocations", owned_subkey(AUTHORIZER.public_key), value)
    with pytest.raises(RecordRejected):
        check("r/revocations", owned_subkey(NodeKey.generate().public_key), value)
    with pytest.raises(RecordRejected):
        check("r/revocations", "open-subkey", value)
    with pytest.raises(RecordRejected):
        check(
            "r/revocations", owned_subkey(AUTHORIZER.public_key), {"nodes": [1], "accounts": [], "updated": 0}
        )
    with pytest.raises(RecordRejected):  # an open run has no authorizer: nobody writes it
        check_revocations(None)("r/revocations", owned_subkey(AUTHORIZER.public_key), value)
    assert Revocations.from_value(value).revokes("n") and Revocations.from_value(value).revokes("x", "a")
