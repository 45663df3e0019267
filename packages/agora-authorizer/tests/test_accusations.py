"""The accusation judge: who counts as an independent accuser (the rules, on their own), and
the judge at work in a running authorizer, reading accusations real DHT nodes on 127.0.0.1
publish, banning, revoking and publishing the revocation list; and the operator's
``accusations`` and ``pardon`` commands on its SQLite database."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import structlog
from click.testing import CliRunner

from agora_authorizer.accusations import Charge, charges, discount
from agora_authorizer.cli import main
from agora_authorizer.service import Authorizer
from agora_authorizer.store import Docket, IssuedCredential, RecordedAccusation, Store
from agora_core.admission.accusations import Accusation, AccuserRecord, Evidence, accusations_key
from agora_core.admission.credential import Credential, SignedCredential, issue_credential
from agora_core.admission.revocations import Revocations, revocations_key
from agora_core.config import RunConfig
from agora_core.dht.owned import OwnedEntry
from agora_core.identity import NodeKey
from agora_core.node.run_node import RunNode
from agora_core.observability.metrics import NodeMetrics
from agora_devkit.authorizer import signed_credential, small_run, write_run
from agora_devkit.processes import poll_until

NOW = 1_700_000_000.0


# --- the rules, on their own ----------------------------------------------------------------


def held(
    node_id: str, account: str, stage: int | None = 1, *, expires=NOW + 600, revoked=None, role="worker"
):
    return IssuedCredential(
        serial=1,
        request_id=None,
        node_id=node_id,
        public_key=bytes(32),
        role=role,
        stage=stage,
        account=account,
        issued=NOW - 60,
        expires=expires,
        body=b"",
        signature=b"",
        revoked=revoked,
    )


def accused_by(accuser: str, accused: str = "x", *, at=NOW - 10, seen=NOW - 9, kind="averaging_values"):
    return RecordedAccusation(
        accuser=accuser,
        accused=accused,
        kind=kind,
        accuser_stage=1,
        rounds=3,
        at=at,
        at_seen=seen,
        evidence=[],
        first_seen=seen,
        last_seen=NOW,
    )


def docket(*accusations: RecordedAccusation, credentials, pardons=None) -> Docket:
    by_node = {c.node_id: c for c in credentials}
    return Docket(accusations=accusations, credentials=by_node, pardons=pardons or {}, banned=frozenset())


@pytest.mark.parametrize(
    "accuser, why",
    [
        (held("a", "alice", expires=NOW - 1), "no live credential"),
        (held("a", "alice", revoked=NOW - 5), "no live credential"),
        (held("a", "alice", stage=0), "stage 0, the accused stage 1"),
        (held("a", "xavier"), "own account 'xavier'"),
        (None, "no live credential"),
    ],
)
def test_an_accuser_without_a_live_credential_on_the_stage_of_another_account_does_not_count(accuser, why):
    credentials = {"x": held("x", "xavier")} | ({} if accuser is None else {"a": accuser})
    assert why in discount(accused_by("a"), credentials, {}, anchors=(), now=NOW)
    credentials["a"] = held("a", "alice")
    assert discount(accused_by("a"), credentials, {}, anchors=(), now=NOW) is None


def test_only_a_trainer_accuses_of_compute_and_only_a_worker_of_its_stage_of_averaging():
    trainer = held("t", "tom", stage=None, role="trainer")
    credentials = {"x": held("x", "xavier"), "t": trainer, "a": held("a", "alice")}
    checked = accused_by("t", kind="compute_output")
    assert discount(checked, credentials, {}, anchors=(), now=NOW) is None  # a trainer has no stage
    assert "only a trainer" in discount(
        accused_by("a", kind="compute_output"), credentials, {}, anchors=(), now=NOW
    )
    assert "stage None" in discount(accused_by("t"), credentials, {}, anchors=(), now=NOW)
    credentials["t"] = dataclasses.replace(trainer, expires=NOW - 1)
    assert "no live credential" in discount(checked, credentials, {}, anchors=(), now=NOW)


def test_one_anchor_trainers_spot_checks_convict_and_another_trainers_need_a_second_account():
    nodes = [held("t1", "tom", stage=None, role="trainer"), held("o1", "ops", stage=None, role="trainer")]
    credentials = [held("x", "xavier"), *nodes, held("a", "alice")]
    outsider = charges(
        docket(accused_by("t1", kind="compute_output"), credentials=credentials), anchors={"ops"}, now=NOW
    )
    assert not outsider["x"].anchor_checked
    assert not outsider["x"].convicts(2, anchor_checks=True)  # one account alone never bans
    anchor = charges(
        docket(accused_by("o1", kind="compute_output"), credentials=credentials), anchors={"ops"}, now=NOW
    )
    assert anchor["x"].anchor_checked and anchor["x"].convicts(2, anchor_checks=True)
    assert not anchor["x"].convicts(2, anchor_checks=False)  # the run's policy turns it off
    assert not anchor["x"].convicts(0, anchor_checks=True)  # 0: accusations are only listed
    # an anchor worker's averaging accusation is one witness, not a conviction
    worker = charges(docket(accused_by("a"), credentials=credentials), anchors={"alice"}, now=NOW)
    assert not worker["x"].anchor_checked and not worker["x"].convicts(2, anchor_checks=True)
    # a trainer and a worker of two accounts are two independent accusers
    both = docket(accused_by("t1", kind="compute_output"), accused_by("a"), credentials=credentials)
    assert charges(both, anchors=(), now=NOW)["x"].convicts(2, anchor_checks=True)


def test_an_accused_without_a_stage_is_not_judged():
    credentials = {"x": held("x", "xavier", stage=None), "a": held("a", "alice")}
    assert "no credential for a stage" in discount(accused_by("a"), credentials, {}, anchors=(), now=NOW)
    assert "no credential" in discount(accused_by("a"), {"a": held("a", "alice")}, {}, anchors=(), now=NOW)


def test_nodes_of_one_account_are_one_accuser_and_each_anchor_node_counts_on_its_own():
    nodes = [held(f"s{i}", "sybil") for i in range(5)] + [held("o1", "ops"), held("o2", "ops")]
    case = docket(
        *(accused_by(c.node_id) for c in nodes),
        accused_by("o1", kind="averaging_weight"),
        credentials=[held("x", "xavier"), *nodes],
    )
    [charge] = charges(case, anchors=(), now=NOW).values()
    assert charge.witnesses == {"sybil", "ops"} and len(charge.accusers) == 7
    charge = charges(case, anchors={"ops"}, now=NOW)["x"]
    assert charge.witnesses == {"sybil", "ops/o1", "ops/o2"}
    assert charge.kinds == {"averaging_values", "averaging_weight"}
    assert charge.reason() == (
        "accused of averaging_values, averaging_weight by 3 independent accusers (ops/o1, ops/o2, sybil)"
    )
    # an anchor's nodes count against a node of their own account too
    own = docket(accused_by("o1"), accused_by("o2"), credentials=[held("x", "ops"), *nodes])
    assert charges(own, anchors={"ops"}, now=NOW)["x"].witnesses == {"ops/o1", "ops/o2"}
    assert charges(own, anchors=(), now=NOW) == {}


def test_only_accusations_made_after_the_pardon_count():
    credentials = [held("x", "xavier"), held("a", "alice"), held("b", "bob")]
    before = docket(
        accused_by("a", at=NOW - 10), accused_by("b"), credentials=credentials, pardons={"x": NOW - 5}
    )
    assert charges(before, anchors=(), now=NOW) == {}
    # an accuser's clock set ahead does not lift its accusation past a pardon: it dates from
    # when the authorizer read it
    ahead = docket(
        accused_by("a", at=NOW + 3600, seen=NOW - 6), credentials=credentials, pardons={"x": NOW - 5}
    )
    assert charges(ahead, anchors=(), now=NOW) == {}
    after = docket(
        accused_by("a", at=NOW - 4, seen=NOW - 3),
        accused_by("b", at=NOW - 10),
        credentials=credentials,
        pardons={"x": NOW - 5},
    )
    assert charges(after, anchors=(), now=NOW)["x"].witnesses == {"alice"}


# --- the judge in a running authorizer, over a real DHT ---------------------------------------


@dataclass
class Court:
    """A running authorizer on a SQLite file, and the DHT members a test adds to its run."""

    authz: Authorizer
    store: Store
    run: RunConfig
    key: NodeKey
    db: str
    config_file: Path
    members: list[Member] = field(default_factory=list)

    def enroll(self, node: NodeKey, *, account: str, stage: int | None, issued: float, lifetime_s: float):
        """Record and sign a worker credential for ``node``, as the service issues one."""
        signed: dict[str, SignedCredential] = {}

        def sign(serial: int) -> tuple[bytes, bytes]:
            fields = Credential(
                run=self.run.name,
                node_id=node.node_id,
                public_key=node.public_key,
                role="worker",
                stage=stage,
                issued=issued,
                expires=issued + lifetime_s,
                serial=serial,
                account=account,
            )
            signed["credential"] = issue_credential(self.key, fields)
            return signed["credential"].message.body, signed["credential"].message.signature

        self.store.issue_credential(
            request_id=None,
            node_id=node.node_id,
            public_key=node.public_key,
            role="worker",
            stage=stage,
            account=account,
            issued=issued,
            expires=issued + lifetime_s,
            sign=sign,
        )
        return signed["credential"]

    def accused(self, account: str = "target", stage: int = 0) -> str:
        """A worker admitted on ``stage`` (a credential on record; it need not be online)."""
        key = NodeKey.generate()
        self.enroll(key, account=account, stage=stage, issued=time.time(), lifetime_s=600.0)
        return key.node_id

    async def member(self, account: str, stage: int = 0, *, on_record: str = "live") -> Member:
        """A DHT member of the run. ``on_record``: its credential in the authorizer's
        database is "live", "expired", or "none" (it holds one signed outside it)."""
        key = NodeKey.generate()
        now = time.time()
        if on_record == "live":
            credential = self.enroll(key, account=account, stage=stage, issued=now, lifetime_s=600.0)
        else:
            if on_record == "expired":
                self.enroll(key, account=account, stage=stage, issued=now - 700.0, lifetime_s=600.0)
            credential = signed_credential(self.key, self.run, key, role="worker", stage=stage)
        node = RunNode(
            run=self.run,
            key=key,
            metrics=NodeMetrics(role="test"),
            authorizer=self.authz.address,
            credential=credential,
        )
        member = Member(key, stage, node, self.run)
        self.members.append(member)
        await node.start()
        return member

    async def recorded(self, accused: str, count: int, *, after: float = 0.0) -> None:
        """Wait until the service has recorded ``count`` accusations against ``accused`` last
        read at or after ``after``."""

        async def check() -> bool:
            found = self.store.docket(accused=accused, with_banned=True).accusations
            return len([a for a in found if a.last_seen >= after]) >= count

        await poll_until(check, timeout_s=30, what=f"{count} accusations against {accused[:12]} recorded")

    async def banned(self, node_id: str) -> None:
        async def check() -> bool:
            return self.store.is_banned("node", node_id)

        await poll_until(check, timeout_s=30, what=f"node {node_id[:12]} banned")

    async def revoked(self, node_id: str, logs: list[dict]) -> dict:
        """Wait for ``node_id``'s ban and then its ``node_revoked_by_accusations`` line in
        ``logs`` (captured): the judge logs once the ban's database write has returned to it,
        which may be after a poll of the database already saw the ban."""
        await self.banned(node_id)

        def found() -> list[dict]:
            return [e for e in logs if e["event"] == "node_revoked_by_accusations" and e["node"] == node_id]

        async def logged() -> bool:
            return bool(found())

        await poll_until(logged, timeout_s=10, what=f"node {node_id[:12]}'s revocation logged")
        [event] = found()
        return event

    def cli(self, *args: str) -> object:
        return CliRunner().invoke(main, [*args, "--db", self.db], catch_exceptions=False)


@dataclass
class Member:
    key: NodeKey
    stage: int
    node: RunNode
    run: RunConfig

    async def accuse(self, *accused: str, at: float | None = None, kind: str = "averaging_values") -> None:
        """Publish this node's accusations entry (replacing its previous one)."""
        at = time.time() if at is None else at
        evidence = (Evidence(round=12, slice=3, chunk=0, measured=9.0, radius=1.5),)
        record = AccuserRecord(
            self.key.node_id,
            self.stage,
            tuple(Accusation(node_id, kind, rounds=3, at=at, evidence=evidence) for node_id in accused),
            time.time(),
        )
        entry = OwnedEntry(self.node.dht, self.key, accusations_key(self.run.name))
        await entry.publish(record.to_value(), self.run.dht.record_ttl_s)

    async def revocations(self) -> Revocations | None:
        values = await self.node.dht.get(revocations_key(self.run.name))
        return next((Revocations.from_value(v.value) for v in values.values()), None)


@contextlib.asynccontextmanager
async def court(tmp_path: Path, **admission) -> AsyncIterator[Court]:
    """An authorizer of a run whose judge looks every second (a 3 s credential lifetime: its
    revocation publisher's period is 1 s), on a SQLite file; everything stopped at the end."""
    key = NodeKey.generate()
    run, config_file = write_run(tmp_path, small_run(credential_lifetime_s=3.0, **admission), key)
    db = str(tmp_path / "authorizer.db")
    store = Store.open(db)
    authz = Authorizer(run=run, key=key, store=store)
    assert authz.judge.period_s == 1.0
    held = Court(authz, store, run, key, db, config_file)
    try:
        await authz.start()
        yield held
    finally:
        for member in held.members:
            await member.node.stop()
        await authz.stop()
        store.close()


async def test_two_accusers_of_distinct_accounts_get_a_node_banned_revoked_and_published(tmp_path):
    async with court(tmp_path) as c:
        accused = c.accused("mallory", stage=0)
        alice, bob = await c.member("alice"), await c.member("bob")
        with structlog.testing.capture_logs() as logs:
            await alice.accuse(accused)
            await c.recorded(accused, 1)
            assert not c.store.is_banned("node", accused)  # one accuser: nothing yet
            await bob.accuse(accused, kind="averaging_reducer")
            event = await c.revoked(accused, logs)
        [ban] = [b for b in c.store.bans() if b.target == accused]
        assert (
            ban.reason
            == "accused of averaging_reducer, averaging_values by 2 independent accusers (alice, bob)"
        )
        assert c.store.latest_credential_of(accused).revoked is not None
        assert event["accusers"] == 2 and event["credentials_revoked"] == 1

        async def published() -> bool:  # the judge published at once: no wait for the publisher's beat
            revocations = await alice.revocations()
            return revocations is not None and accused in revocations.nodes

        await poll_until(published, timeout_s=10, what="the accused in the DHT revocation list")
        # banned once: later passes leave the ban as it was
        assert await c.authz.judge.judge() == []
        assert [b.reason for b in c.store.bans() if b.target == accused] == [ban.reason]


async def test_two_nodes_of_an_anchor_account_get_a_node_of_it_banned_and_the_log_names_only_it(tmp_path):
    """The operator's own nodes (a local swarm's) each count, whichever account the accused."""
    async with court(tmp_path, anchor_accounts=["ops"]) as c:
        accused = c.accused("ops")
        first, second = await c.member("ops"), await c.member("ops")
        with structlog.testing.capture_logs() as logs:
            await first.accuse(accused)
            await second.accuse(accused)
            event = await c.revoked(accused, logs)
        # tools read the revoked node off this line: the accused is the only full node id in it
        assert re.findall(r"[0-9a-f]{40}", repr(event)) == [accused]
        assert event["witnesses"] == sorted(f"ops/{m.key.node_id[:12]}" for m in (first, second))


async def test_one_account_other_stages_and_accusers_without_live_credentials_ban_nobody(tmp_path):
    async with court(tmp_path) as c:
        accused = c.accused("target", stage=0)
        accusers = [
            *[await c.member("sybil") for _ in range(3)],  # one account: one accuser
            await c.member("other", stage=1),  # another stage
            await c.member("another", stage=1),
            await c.member("target"),  # the accused's own account
            await c.member("gone", on_record="expired"),
            await c.member("stranger", on_record="none"),
        ]
        for accuser in accusers:
            await accuser.accuse(accused)
        await c.recorded(accused, len(accusers))
        assert await c.authz.judge.judge() == []  # a pass after all were recorded
        assert not c.store.is_banned("node", accused)
        assert c.store.latest_credential_of(accused).revoked is None

        result = c.cli("accusations", "--json", "--node", accused)
        [node] = json.loads(result.output)["accused"]
        assert node["independent_accusers"] == 1 and node["witnesses"] == ["sybil"] and not node["banned"]
        why_not = sorted(a["why_not"] for a in node["accusations"] if not a["counts"])
        assert why_not == [
            "the accuser holds no live credential",
            "the accuser holds no live credential",
            "the accuser is of the accused's own account 'target'",
            "the accuser serves stage 1, the accused stage 0",
            "the accuser serves stage 1, the accused stage 0",
        ]


async def test_with_revoke_after_accusers_0_accusations_are_recorded_and_nobody_is_banned(tmp_path):
    async with court(tmp_path, revoke_after_accusers=0) as c:
        accused = c.accused("mallory")
        for account in ("alice", "bob", "carol"):
            await (await c.member(account)).accuse(accused)
        await c.recorded(accused, 3)
        assert await c.authz.judge.judge() == []
        assert not c.store.is_banned("node", accused)
        text = c.cli("accusations", "--config", str(c.config_file)).output
        assert "never revoked (revoke_after_accusers = 0)" in text
        assert "3 independent accusers: alice, bob, carol" in text and "not banned" in text


async def test_a_pardoned_node_is_banned_again_only_on_accusations_made_after_the_pardon(tmp_path):
    async with court(tmp_path) as c:
        accused = c.accused("mallory")
        alice, bob = await c.member("alice"), await c.member("bob")
        first = time.time()
        await alice.accuse(accused, at=first)
        await bob.accuse(accused, at=first)
        await c.banned(accused)

        pardoned = c.cli("pardon", accused)
        assert pardoned.exit_code == 0, pardoned.output
        assert f"pardoned node {accused}: lifted its ban (accused of averaging_values by 2" in pardoned.output
        assert "2 accusations forgiven" in pardoned.output
        assert not c.store.is_banned("node", accused)
        # the accusers' entries still stand in the DHT: read again, they ban nobody
        after = time.time()
        await c.recorded(accused, 2, after=after)
        assert await c.authz.judge.judge() == []
        assert not c.store.is_banned("node", accused)
        text = c.cli("accusations").output
        assert "not banned; pardoned" in text and text.count("made before the accused was pardoned") == 2

        # they see it again, after the pardon: banned again
        await alice.accuse(accused)
        await bob.accuse(accused)
        await c.banned(accused)
        nothing = c.cli("pardon", NodeKey.generate().node_id)
        assert nothing.exit_code == 1 and "nothing to pardon" in nothing.output


# --- the commands on a database alone ---------------------------------------------------------


def test_the_accusations_command_lists_by_accused_with_ban_pardon_and_evidence(tmp_path):
    db = str(tmp_path / "authorizer.db")
    x, y = NodeKey.generate().node_id, NodeKey.generate().node_id
    now = time.time()
    with Store.open(db) as store:
        for node_id, account in ((x, "xavier"), (y, "yvonne"), ("a" * 40, "alice"), ("b" * 40, "bob")):
            store.issue_credential(
                request_id=None,
                node_id=node_id,
                public_key=bytes(32),
                role="worker",
                stage=1,
                account=account,
                issued=now,
                expires=now + 600,
                sign=lambda serial: (b"body", b"signature"),
            )
        evidence = (Evidence(round=12, slice=3, chunk=0, measured=9.0, radius=1.5),)
        records = [
            AccuserRecord("a" * 40, 1, (Accusation(x, "averaging_values", 4, now - 5, evidence),), now),
            AccuserRecord("b" * 40, 1, (Accusation(x, "averaging_values", 2, now - 9, evidence),), now),
            AccuserRecord("b" * 40, 1, (Accusation(y, "averaging_weight", 1, now - 9),), now),
        ]
        store.record_accusations(records, now=now)
        store.ban_accused(x, reason="accused of averaging_values by 2", pardoned=None, now=now)
    runner = CliRunner()

    report = json.loads(runner.invoke(main, ["accusations", "--db", db, "--json"]).output)
    assert [n["node_id"] for n in report["accused"]] == [x, y]  # most independent accusers first
    first = report["accused"][0]
    assert first["banned"] and first["ban_reason"] == "accused of averaging_values by 2"
    assert first["independent_accusers"] == 2 and [a["accuser"] for a in first["accusations"]] == [
        "a" * 40,
        "b" * 40,
    ]
    assert first["accusations"][0]["evidence"] == [
        {"round": 12, "slice": 3, "chunk": 0, "measured": 9.0, "radius": 1.5}
    ]
    assert report["revoke_after_accusers"] is None  # no --config

    text = runner.invoke(main, ["accusations", "--db", db]).output
    assert f"node {x}  stage 1, account xavier" in text and "banned: accused of averaging_values by 2" in text
    assert "by aaaaaaaaaaaa (alice): averaging_values, 4 rounds" in text
    assert "without the run's anchor accounts" in text
    only = runner.invoke(main, ["accusations", "--db", db, "--node", y]).output
    assert y in only and x not in only
    none = runner.invoke(main, ["accusations", "--db", db, "--node", "c" * 40]).output
    assert none.startswith(f"no accusations recorded against {'c' * 40}")


def test_the_pardon_command_says_what_it_did_and_exits_1_with_nothing_to_pardon(tmp_path):
    db = str(tmp_path / "authorizer.db")
    banned, accused = NodeKey.generate().node_id, NodeKey.generate().node_id
    with Store.open(db) as store:
        store.ban("node", banned, reason="banned by the operator", now=time.time())
        store.record_accusations(
            [AccuserRecord("a" * 40, 0, (Accusation(accused, "averaging_values", 3, 1.0),), 1.0)],
            now=time.time(),
        )
    runner = CliRunner()

    lifted = runner.invoke(main, ["pardon", banned, "--db", db])
    assert lifted.exit_code == 0
    assert (
        f"pardoned node {banned}: lifted its ban (banned by the operator); 0 accusations forgiven"
        in lifted.output
    )
    assert "joins again through the checks" in lifted.output
    forgiven = runner.invoke(main, ["pardon", accused, "--db", db])
    assert forgiven.exit_code == 0 and "it was not banned; 1 accusations forgiven" in forgiven.output
    for node_id in (banned, accused):  # pardoned already, nothing new
        again = runner.invoke(main, ["pardon", node_id, "--db", db])
        assert again.exit_code == 1 and f"nothing to pardon: node {node_id}" in again.output
    bad = runner.invoke(main, ["pardon", "not-a-node", "--db", db])
    assert bad.exit_code == 2 and "not a node id" in bad.output
    with Store.open(db) as store:
        assert store.bans() == [] and set(store.docket(with_banned=True).pardons) == {accused}


def test_a_charge_names_its_kinds_and_accusers_in_the_ban_reason():
    charge = Charge("x", 0, "xavier", witnesses={"bob", "alice"}, kinds={"averaging_values"})
    assert charge.reason() == "accused of averaging_values by 2 independent accusers (alice, bob)"
    assert dataclasses.replace(charge, witnesses={"ops/" + "f" * 40}).reason().endswith("(ops/ffffffffffff)")
