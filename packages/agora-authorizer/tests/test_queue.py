"""The admission queue under load and across a crash: the configured rate, arrival order,
and nothing lost when the authorizer is SIGKILLed mid-admission (SQLite and PostgreSQL)."""

from __future__ import annotations

import asyncio
import json

import pytest

from agora_core.admission.join_client import AdmissionRefused
from agora_core.identity import NodeKey
from agora_devkit.authorizer import TestJoiner, authorizer_process, small_run

pytestmark = pytest.mark.slow


async def start_joiners(authz, count: int) -> list[TestJoiner]:
    return list(await asyncio.gather(*(TestJoiner(authz.run, authz.address).start() for _ in range(count))))


async def close_all(joiners: list[TestJoiner]) -> None:
    await asyncio.gather(*(j.close() for j in joiners), return_exceptions=True)


def issued_at(status) -> float:
    return status.credential.credential.issued


async def test_a_hundred_concurrent_joiners_are_admitted_at_the_configured_rate_in_arrival_order(tmp_path):
    rate_per_s, burst, count = 20.0, 2, 100
    run = small_run(admissions_per_minute=rate_per_s * 60, admission_burst=burst)
    with authorizer_process(tmp_path / "authz", run) as authz:
        token = authz.add_account("crowd", max_nodes=count)
        joiners = await start_joiners(authz, count)
        try:
            first = await asyncio.gather(*(j.join("crowd", token) for j in joiners))
            assert all(s.status in ("queued", "admitted") for s in first), [
                s for s in first if s.status == "refused"
            ]
            queued = [s for s in first if s.status == "queued"]
            assert queued and all(s.position and s.eta_s is not None for s in queued)  # told where they stand
            final = await asyncio.gather(*(j.admission.wait(timeout_s=120) for j in joiners))
        finally:
            await close_all(joiners)
        by_arrival = sorted(final, key=lambda s: s.request_id)
        times = [issued_at(s) for s in by_arrival]
        assert times == sorted(times), "admitted out of arrival order"
        serials = [s.credential.credential.serial for s in by_arrival]
        assert serials == sorted(serials)
        # a token bucket never admits more than burst + rate x window in any window
        for i in range(len(times)):
            for j in range(i + 1, len(times)):
                assert j - i + 1 <= burst + rate_per_s * (times[j] - times[i]) + 1e-6 + 1, (i, j)
        span = times[-1] - times[0]
        assert span >= (count - burst - 1) / rate_per_s * 0.95
        stages = json.loads(authz.cli("status", "--json").stdout)["admitted"]["workers_per_stage"]
        assert sorted(stages.values()) == [count // 2, count // 2], stages  # placement balanced the stages


async def test_a_sigkilled_authorizer_loses_nothing_and_resumes_the_queue_in_order(tmp_path, db_url):
    run = small_run(admissions_per_minute=120.0, admission_burst=1)  # one every 0.5 s
    key = NodeKey.generate()
    directory = tmp_path / "authz"
    count = 8
    with authorizer_process(directory, run, db=db_url, key=key) as authz:
        token = authz.add_account("crash", max_nodes=count)
        joiners = await start_joiners(authz, count)
        try:
            first = await asyncio.gather(*(j.join("crash", token) for j in joiners))
            assert all(s.status in ("queued", "admitted") for s in first)
            third = sorted(zip(first, joiners, strict=True), key=lambda pair: pair[0].request_id)[2][1]
            await third.admission.wait(timeout_s=30)  # the first three admitted, the rest queued
            before = await asyncio.gather(*(j.admission.poll() for j in joiners))
            authz.child.kill()
        except BaseException:
            await close_all(joiners)
            raise
    admitted_before = {
        j.key.node_id: s.credential.credential.serial
        for j, s in zip(joiners, before, strict=True)
        if s.status == "admitted"
    }
    try:
        assert 3 <= len(admitted_before) < count, "the kill should land mid-queue"
        with authorizer_process(directory, run, db=db_url, key=key) as authz:
            for joiner in joiners:  # the restarted authorizer listens on another port
                joiner.use_authorizer(authz.address)
            final = await asyncio.gather(*(j.admission.wait(timeout_s=60) for j in joiners))
            report = json.loads(authz.cli("status", "--json").stdout)
    finally:
        await close_all(joiners)
    for joiner, status in zip(joiners, final, strict=True):
        assert status.status == "admitted"
        if joiner.key.node_id in admitted_before:  # the credential it held is the one on record
            assert status.credential.credential.serial == admitted_before[joiner.key.node_id]
    by_arrival = sorted(final, key=lambda s: s.request_id)
    assert [issued_at(s) for s in by_arrival] == sorted(issued_at(s) for s in by_arrival)
    assert report["requests"].get("admitted") == count and not report["queue"]


async def test_a_node_banned_while_it_waits_in_the_queue_is_refused_not_admitted(tmp_path):
    run = small_run(admissions_per_minute=6.0, admission_burst=1)  # one every 10 s: the second waits
    with authorizer_process(tmp_path / "authz", run) as authz:
        token = authz.add_account("waiting", max_nodes=4)
        joiners = await start_joiners(authz, 2)
        try:
            first = await joiners[0].join("waiting", token)
            second = await joiners[1].join("waiting", token)
            assert first.status == "admitted" and second.status == "queued", (first, second)
            authz.cli("ban", joiners[1].key.node_id)
            with pytest.raises(AdmissionRefused) as refused:
                await joiners[1].admission.wait(timeout_s=60)
            assert refused.value.reason == "banned_node"
            # a node joining again under its account does not count against itself
            again = await joiners[0].join("waiting", token)
            assert again.status in ("queued", "admitted") and again.reason == ""
        finally:
            await close_all(joiners)
        report = json.loads(authz.cli("status", "--json").stdout)
        assert report["refusals"].get("banned_node") == 1
        assert joiners[1].key.node_id not in [n["node_id"] for n in report["nodes"]]
