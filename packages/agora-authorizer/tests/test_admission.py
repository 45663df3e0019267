"""Admission through a real authorizer process: what it admits, what it refuses and why.

One authorizer serves the module (each test makes its own account and joiners); tests that
need other settings start their own.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import numpy as np
import pytest

from agora_core.admission import (
    CredentialError,
    sign_join_request,
    verify_credential,
)
from agora_core.admission.join_client import AdmissionRefused
from agora_core.admission.join_request import JOIN_CONTEXT
from agora_core.admission.revocations import Revocations, revocations_key
from agora_core.admission.signed import sign_map
from agora_core.contract import Method
from agora_core.dht.records import RecordRejected, owned_subkey
from agora_core.identity import NodeKey
from agora_devkit.authorizer import GB, TestJoiner, authorizer_process, small_run
from agora_devkit.processes import poll_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def authz(tmp_path_factory):
    run = small_run(min_device_memory_gb=1.0, min_host_memory_gb=0.5)
    with authorizer_process(tmp_path_factory.mktemp("authz"), run, extra=("--allow-local-build",)) as process:
        yield process


@pytest.fixture
def account(authz):
    name = f"acct-{uuid.uuid4().hex[:8]}"
    return name, authz.add_account(name)


async def joined(authz, account, **overrides):
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        return joiner, await joiner.join(*account, **overrides)
    except BaseException:
        await joiner.close()
        raise


def status_json(authz) -> dict:
    return json.loads(authz.cli("status", "--json").stdout)


async def test_an_admitted_worker_holds_a_credential_any_node_can_check(authz, account):
    joiner, status = await joined(authz, account)
    try:
        assert status.status == "admitted", status
        credential = status.credential.credential
        assert credential.node_id == joiner.key.node_id and credential.role == "worker"
        assert credential.stage in (0, 1) and status.stage == credential.stage
        assert credential.expires - credential.issued == pytest.approx(
            authz.run.admission.credential_lifetime_s
        )
        verify_credential(
            status.credential.to_value(),
            authorizer_public_key=authz.key.public_key,
            run=authz.run.name,
            public_key=joiner.key.public_key,
        )
        with pytest.raises(CredentialError) as other_run:
            verify_credential(
                status.credential.to_value(), authorizer_public_key=authz.key.public_key, run="other"
            )
        assert other_run.value.reason == "other_run"
        with pytest.raises(CredentialError) as expired:
            verify_credential(
                status.credential.to_value(),
                authorizer_public_key=authz.key.public_key,
                run=authz.run.name,
                now=credential.expires + 60,
            )
        assert expired.value.reason == "expired"
        with pytest.raises(CredentialError) as forged:  # signed by someone else
            verify_credential(
                status.credential.to_value(),
                authorizer_public_key=NodeKey.generate().public_key,
                run=authz.run.name,
            )
        assert forged.value.reason == "bad_signature"
        # the dial-back ran: the joiner computed the challenge
        assert joiner.answerer.challenges == 1
        report = status_json(authz)
        assert joiner.key.node_id in [n["node_id"] for n in report["nodes"]]
        # a refresh gives a new credential for the same stage
        keeper = joiner.keeper(status.credential)
        fresh = await keeper.refresh()
        assert fresh.credential.serial > credential.serial and fresh.credential.stage == credential.stage
    finally:
        await joiner.close()


async def test_a_forged_signature_is_refused_and_recorded(authz, account):
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        request = joiner.request(*account)
        forged = sign_map(NodeKey.generate(), JOIN_CONTEXT, request.to_fields())  # not the key it names
        reply = await joiner.client.call(authz.address, Method.ADMISSION_JOIN, {"request": forged.to_value()})
        assert reply.meta["status"] == "refused" and reply.meta["reason"] == "bad_signature"
        assert status_json(authz)["refusals"].get("bad_signature", 0) >= 1
        garbage = await joiner.client.call(authz.address, Method.ADMISSION_JOIN, {"request": {"body": b"x"}})
        assert garbage.meta["reason"] == "malformed"
    finally:
        await joiner.close()


async def test_a_replayed_or_stale_request_is_refused(authz, account):
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        signed = sign_join_request(joiner.key, joiner.request(*account))
        first = await joiner.client.call(authz.address, Method.ADMISSION_JOIN, {"request": signed.to_value()})
        assert first.meta["status"] == "admitted"
        again = await joiner.client.call(authz.address, Method.ADMISSION_JOIN, {"request": signed.to_value()})
        assert again.meta["status"] == "refused" and again.meta["reason"] == "replayed"
        stale = await joiner.join(*account, timestamp=time.time() - 3600)
        assert stale.status == "refused" and stale.reason == "stale"
        other = await joiner.join(*account, run="another-run")
        assert other.reason == "other_run"
    finally:
        await joiner.close()


async def test_a_node_that_cannot_be_dialed_back_or_answers_with_another_key_is_refused(authz, account):
    joiner = await TestJoiner(authz.run, authz.address).start()
    impostor = await TestJoiner(authz.run, authz.address).start()
    try:
        port = joiner.address.rsplit(":", 1)[1]
        await joiner.server.stop()  # nothing listens at the advertised address any more
        gone = await joiner.join(*account, address=f"tcp://127.0.0.1:{port}")
        assert gone.status == "refused" and gone.reason == "unreachable", gone
        wrong = await impostor.join(
            *account, address=(await TestJoiner(authz.run, authz.address).start()).address
        )
        assert wrong.reason in ("key_mismatch", "unreachable")
        other = await TestJoiner(authz.run, authz.address).start()
        try:
            answered_by_other = await impostor.join(*account, address=other.address)
            assert answered_by_other.reason == "key_mismatch", answered_by_other
        finally:
            await other.close()
    finally:
        await joiner.client.close()
        await impostor.close()


async def test_a_wrong_software_digest_and_a_wrong_challenge_answer_are_refused(authz, account):
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        software = {
            name: {**report, "digest": "0" * 64} for name, report in joiner.request(*account).software.items()
        }
        status = await joiner.join(*account, software=software)
        assert status.status == "refused" and status.reason == "software", status
        assert "differ" in status.detail
        old = {name: {**report, "version": "0.0.1"} for name, report in software.items()}
        assert (await joiner.join(*account, software=old)).reason == "software"
        joiner.answerer.matmul = lambda a, b: np.matmul(a, b) + 1  # a device that computes wrong
        wrong = await joiner.join(*account)
        assert wrong.reason == "challenge_wrong", wrong
    finally:
        await joiner.close()


async def test_hardware_below_the_floors_is_refused(authz, account):
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        hardware = joiner.request(*account).hardware
        small = await joiner.join(
            *account, hardware=dataclasses.replace(hardware, device_memory_bytes=GB // 2)
        )
        assert small.reason == "device_memory" and "1 GB" in small.detail
        no_ram = await joiner.join(*account, hardware=dataclasses.replace(hardware, host_memory_bytes=0))
        assert no_ram.reason == "host_memory"
        # a trainer needs no accelerator
        trainer = await TestJoiner(authz.run, authz.address, role="trainer").start()
        try:
            admitted = await trainer.join(
                *account, hardware=dataclasses.replace(hardware, device_memory_bytes=0)
            )
            assert admitted.status == "admitted" and admitted.credential.credential.stage is None
        finally:
            await trainer.close()
    finally:
        await joiner.close()


async def test_a_banned_or_unknown_account_and_a_full_one_are_refused(authz, account):
    name, token = account
    joiner = await TestJoiner(authz.run, authz.address).start()
    try:
        assert (await joiner.join(name, "wrong-token")).reason == "unknown_account"
        assert (await joiner.join("nobody", token)).reason == "unknown_account"
        limited = f"one-{uuid.uuid4().hex[:6]}"
        limited_token = authz.add_account(limited, max_nodes=1)
        assert (await joiner.join(limited, limited_token)).status == "admitted"
        second = await TestJoiner(authz.run, authz.address).start()
        try:
            assert (await second.join(limited, limited_token)).reason == "account_limit"
        finally:
            await second.close()
        authz.cli("ban", name)
        refused = await joiner.join(name, token)
        assert refused.status == "refused" and refused.reason == "banned_account"
        with pytest.raises(AdmissionRefused):
            await joiner.admission.wait()
    finally:
        await joiner.close()


async def test_a_banned_node_loses_its_refresh_and_is_published_as_revoked(authz, account, tmp_path):
    joiner, status = await joined(authz, account)
    reader = authz.operator_node(tmp_path / "reader.key")
    await reader.start()
    try:
        assert status.status == "admitted"
        authz.cli("ban", joiner.key.node_id, "--reason", "test ban")
        keeper = joiner.keeper(status.credential)
        with pytest.raises(AdmissionRefused) as refused:
            await keeper.refresh()
        assert refused.value.reason == "banned_node"
        key = revocations_key(authz.run.name)

        async def listed() -> bool:
            values = await reader.dht.get(key)
            return any(joiner.key.node_id in Revocations.from_value(v.value).nodes for v in values.values())

        period = min(authz.run.dht.record_ttl_s, authz.run.admission.credential_lifetime_s) / 3
        await poll_until(listed, timeout_s=period + 15, what="the ban in the DHT revocation list")
        # nobody but the authorizer may write the list: a credentialed node that skips the
        # check locally (a modified client) is refused by the replicas
        forger = authz.operator_node(tmp_path / "forger.key")
        forger.dht.records.validate = lambda *args, **kwargs: None
        await forger.start()
        try:
            everyone = {authz.key.node_id, reader.key.node_id, forger.key.node_id}

            async def acquainted() -> bool:  # every replica knows the forger, and it them
                return everyone <= reader.dht.live_ids() and everyone <= forger.dht.live_ids()

            await poll_until(acquainted, timeout_s=15, what="the forger in every member's view")
            forged = Revocations(nodes=(), updated=time.time()).to_value()
            with pytest.raises(RecordRejected):
                await forger.dht.store(
                    key, owned_subkey(forger.key.public_key), forged, time.time() + 30, signer=forger.key
                )
        finally:
            await forger.stop()
        values = await reader.dht.get(key)
        assert set(values) == {owned_subkey(authz.key.public_key)}
    finally:
        await reader.stop()
        await joiner.close()
