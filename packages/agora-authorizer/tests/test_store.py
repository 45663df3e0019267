"""The authorizer's store, on both backends: a fresh SQLite file and a fresh database on a
real PostgreSQL server (the ``db_url`` fixture runs every test on each)."""

from __future__ import annotations

import contextlib
import hashlib
import sqlite3

import pytest
import sqlalchemy as sa

from agora_authorizer.store import AlreadyExists, Ban, NotFound, Store, StoreError, parse_url, schema

NOW = 1_700_000_000.0
KEY = bytes(range(32))


def add_request(store: Store, node_id: str = "n1", *, now: float = NOW, account: str = "alice") -> int:
    return store.add_request(
        node_id=node_id,
        public_key=KEY,
        role="worker",
        address="127.0.0.1:4000",
        account=account,
        hardware={"device": "cuda", "device_memory_bytes": 24 << 30, "gpus": [{"name": "RTX 4090"}]},
        software={"agora-core": "0.1.0"},
        now=now,
    )


def sign(serial: int) -> tuple[bytes, bytes]:
    return b"body-%d" % serial, b"signature-%d" % serial


def issue(
    store: Store, node_id: str = "n1", *, request_id=None, account="alice", issued=NOW, lifetime_s=600.0
):
    return store.issue_credential(
        request_id=request_id,
        node_id=node_id,
        public_key=KEY,
        role="worker",
        stage=2,
        account=account,
        issued=issued,
        expires=issued + lifetime_s,
        sign=sign,
    )


def raw_rows(db_url: str, table: sa.Table) -> list:
    """The table's rows read past the store, straight from the database."""
    engine = sa.create_engine(parse_url(db_url)[0])
    try:
        with engine.connect() as connection:
            return connection.execute(sa.select(table)).all()
    finally:
        engine.dispose()


# --- opening ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "",
        "mysql://root@localhost/agora",
        "authorizer.txt",
        "sqlite://",
        "sqlite:///:memory:",
        "postgresql+psycopg2://h/d",
    ],
)
def test_unsupported_url_is_a_store_error_naming_the_supported_forms(url):
    with pytest.raises(StoreError, match=r"sqlite:///path/to/file\.db|in-memory"):
        Store.open(url)


def test_postgresql_url_uses_psycopg_and_hides_the_password():
    engine_url, shown, backend = parse_url("postgresql://agora:hunter2@db.example:5433/runs")
    assert (engine_url.drivername, backend) == ("postgresql+psycopg", "postgresql")
    assert shown == "postgresql://agora:***@db.example:5433/runs"


def test_unreachable_postgresql_is_a_store_error():
    with pytest.raises(StoreError, match=r"127\.0\.0\.1"):
        Store.open("postgresql://postgres@127.0.0.1:1/agora")


def test_bare_sqlite_path_opens_a_wal_file(tmp_path):
    path = tmp_path / "authorizer.db"
    with Store.open(str(path)) as store:
        assert (store.backend, store.url) == ("sqlite", f"sqlite:///{path}")
        store.ban("node", "n1", reason="test", now=NOW)
    with contextlib.closing(sqlite3.connect(path)) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_database_of_another_schema_version_is_refused(db_url):
    Store.open(db_url).close()
    engine = sa.create_engine(parse_url(db_url)[0])
    with engine.begin() as connection:
        connection.execute(sa.update(schema.schema_info).values(version=schema.SCHEMA_VERSION + 1))
    engine.dispose()
    with pytest.raises(StoreError, match="schema version"):
        Store.open(db_url)


def test_a_closed_store_refuses_calls(store):
    store.close()
    with pytest.raises(StoreError, match="closed"):
        store.accounts()


# --- accounts, bans, pins, nonces ---------------------------------------------------------


def test_account_token_is_checked_and_stored_only_as_its_hash(store, db_url):
    store.add_account("alice", "s3cret-token", max_nodes=3, now=NOW)
    store.add_account("bob", "other", now=NOW + 1)
    alice = store.check_account("alice", "s3cret-token")
    assert (alice.name, alice.max_nodes, alice.created) == ("alice", 3, NOW)
    assert store.check_account("alice", "other") is None
    assert store.check_account("carol", "s3cret-token") is None
    assert [account.name for account in store.accounts()] == ["alice", "bob"]
    [row] = [row for row in raw_rows(db_url, schema.accounts) if row.name == "alice"]
    assert row.token_sha256 == hashlib.sha256(b"s3cret-token").hexdigest()
    assert "s3cret-token" not in repr(raw_rows(db_url, schema.accounts))


def test_taken_account_name_is_already_exists(store):
    store.add_account("alice", "one", now=NOW)
    with pytest.raises(AlreadyExists, match="alice"):
        store.add_account("alice", "two", now=NOW)
    assert store.check_account("alice", "one") is not None
    with pytest.raises(ValueError, match="max_nodes"):
        store.add_account("bob", "t", max_nodes=0, now=NOW)


def test_ban_is_idempotent_and_kinds_are_separate(store):
    store.ban("node", "n1", reason="cheating", now=NOW)
    store.ban("node", "n1", reason="again", now=NOW + 5)
    assert store.bans() == [Ban(kind="node", target="n1", reason="cheating", created=NOW)]
    assert store.is_banned("node", "n1") and not store.is_banned("account", "n1")
    assert store.unban("node", "n1") and not store.unban("node", "n1")
    assert not store.is_banned("node", "n1")
    with pytest.raises(ValueError, match="ban kind"):
        store.ban("ip", "10.0.0.1", reason="", now=NOW)


def test_pin_replaces_the_earlier_pin(store):
    store.pin("n1", 2, now=NOW)
    store.pin("n1", 0, now=NOW + 1)
    assert store.pin_of("n1") == 0 and store.pin_of("n2") is None
    assert store.unpin("n1") and not store.unpin("n1")
    assert store.pin_of("n1") is None
    with pytest.raises(ValueError, match="stage"):
        store.pin("n1", -1, now=NOW)


def test_nonce_seen_twice_is_refused_the_second_time(store):
    assert store.remember_nonce(b"a" * 16, now=NOW)
    assert not store.remember_nonce(b"a" * 16, now=NOW + 1)
    assert store.remember_nonce(b"b" * 16, now=NOW + 1)


def test_forget_nonces_drops_only_the_older_ones(store):
    store.remember_nonce(b"old", now=NOW)
    store.remember_nonce(b"new", now=NOW + 60)
    assert store.forget_nonces(before=NOW + 30) == 1
    assert store.remember_nonce(b"old", now=NOW + 61)
    assert not store.remember_nonce(b"new", now=NOW + 61)


# --- admission requests -------------------------------------------------------------------


def test_request_is_recorded_as_checking_with_its_reports(store):
    request = store.request(add_request(store))
    assert (request.node_id, request.public_key, request.role) == ("n1", KEY, "worker")
    assert (request.status, request.address, request.account) == ("checking", "127.0.0.1:4000", "alice")
    assert request.hardware["gpus"] == [{"name": "RTX 4090"}] and request.software == {"agora-core": "0.1.0"}
    assert (request.received, request.decided, request.checks, request.stage) == (NOW, None, None, None)
    assert store.request(request.id + 1) is None


def test_set_request_keeps_what_it_is_not_given_and_stamps_decisions(store):
    rid = add_request(store)
    checks = {"latency_ms": 12.5, "bandwidth_mbps": 940.0, "challenge_s": 0.8}
    store.set_request(rid, status="queued", stage=1, checks=checks, now=NOW + 1)
    queued = store.request(rid)
    assert (queued.status, queued.stage, queued.checks, queued.decided) == ("queued", 1, checks, None)
    store.set_request(rid, status="refused", reason="bandwidth", detail="measured 3 Mbit/s", now=NOW + 2)
    refused = store.request(rid)
    assert (refused.reason, refused.detail, refused.decided) == ("bandwidth", "measured 3 Mbit/s", NOW + 2)
    assert (refused.stage, refused.checks) == (1, checks)


def test_set_request_refuses_unknown_ids_and_reasonless_refusals(store):
    with pytest.raises(NotFound, match="42"):
        store.set_request(42, status="queued", now=NOW)
    rid = add_request(store)
    with pytest.raises(ValueError, match="reason"):
        store.set_request(rid, status="refused", now=NOW)
    with pytest.raises(ValueError, match="status"):
        store.set_request(rid, status="maybe", now=NOW)
    assert store.request(rid).status == "checking"


def test_queue_order_is_arrival_order(store):
    ids = [add_request(store, f"n{i}", now=NOW + i) for i in range(5)]
    assert ids == sorted(ids) and len(set(ids)) == 5
    for rid in reversed(ids[1:]):  # queued last-first: the queue still follows arrival
        store.set_request(rid, status="queued", stage=0, now=NOW + 10)
    assert [request.id for request in store.queued()] == ids[1:]


def test_queued_stages_counts_queued_workers_with_a_stage(store):
    for i, stage in enumerate([0, 0, 1, None]):
        store.set_request(add_request(store, f"n{i}"), status="queued", stage=stage, now=NOW)
    store.set_request(add_request(store, "n9"), status="refused", reason="latency", stage=1, now=NOW)
    assert store.queued_stages() == {0: 2, 1: 1}


def test_counts_by_status_and_by_refusal_reason(store):
    for i, reason in enumerate(["latency", "latency", "software"]):
        store.set_request(add_request(store, f"n{i}"), status="refused", reason=reason, now=NOW + 10 * i)
    add_request(store, "n9")
    assert store.requests_by_status() == {"refused": 3, "checking": 1}
    assert store.refusals_by_reason() == {"latency": 2, "software": 1}
    assert store.refusals_by_reason(since=NOW + 10) == {"latency": 1, "software": 1}


def test_latest_request_of_a_node_is_its_newest(store):
    first, second = add_request(store, "n1"), add_request(store, "n1", now=NOW + 1)
    add_request(store, "n2")
    assert first < second and store.latest_request_of("n1").id == second
    assert store.latest_request_of("n3") is None


# --- credentials --------------------------------------------------------------------------


def test_issue_credential_assigns_unique_increasing_serials_to_sign(store):
    credentials = [issue(store, f"n{i}") for i in range(5)]
    serials = [credential.serial for credential in credentials]
    assert serials == sorted(serials) and len(set(serials)) == 5
    for credential in credentials:
        assert store.credential(credential.serial) == credential
        assert credential.body == b"body-%d" % credential.serial
    assert store.credential(max(serials) + 1) is None


def test_issue_credential_admits_its_request_in_the_same_transaction(store):
    rid = add_request(store)
    store.set_request(rid, status="queued", stage=2, now=NOW)
    credential = issue(store, request_id=rid, issued=NOW + 5)
    admitted = store.request(rid)
    assert (admitted.status, admitted.decided, admitted.stage) == ("admitted", NOW + 5, 2)
    assert store.latest_credential_of("n1") == credential and credential.request_id == rid
    with pytest.raises(NotFound, match="checking or queued"):  # one admission, one credential
        issue(store, request_id=rid)
    with pytest.raises(NotFound):
        issue(store, "n2", request_id=add_request(store, "n1"))  # another node's request


def test_failed_signing_commits_neither_credential_nor_admission(store):
    rid = add_request(store)

    def broken(serial: int) -> tuple[bytes, bytes]:
        raise OSError("signing key unreadable")

    with pytest.raises(OSError, match="signing key"):
        store.issue_credential(
            request_id=rid, node_id="n1", public_key=KEY, role="worker", stage=0, account="alice",
            issued=NOW, expires=NOW + 600, sign=broken,
        )  # fmt: skip
    assert store.request(rid).status == "checking"
    assert store.latest_credential_of("n1") is None


def test_live_credentials_are_the_newest_unexpired_unrevoked_of_each_node(store):
    issue(store, "n1", issued=NOW)
    newest = issue(store, "n1", issued=NOW + 100)
    issue(store, "n2", issued=NOW - 1000)  # expired
    revoked = issue(store, "n3")
    store.revoke_node("n3", now=NOW + 1)
    kept = issue(store, "n4")
    assert store.live_credentials(now=NOW + 200) == [newest, kept]
    assert store.latest_credential_of("n3").revoked == NOW + 1 and not revoked.revoked


def test_live_nodes_of_account_counts_distinct_nodes(store):
    issue(store, "n1")
    issue(store, "n1", issued=NOW + 1)
    issue(store, "n2")
    issue(store, "n3", issued=NOW - 1000)  # expired
    issue(store, "n4", account="bob")
    assert store.live_nodes_of_account("alice", now=NOW + 10) == 2
    assert store.live_nodes_of_account("carol", now=NOW + 10) == 0


def test_revocations_mark_credentials_once_and_are_listed_since(store):
    for node, account in (("n1", "alice"), ("n1", "alice"), ("n2", "bob"), ("n3", "bob")):
        issue(store, node, account=account)
    store.ban("node", "n9", reason="cheating", now=NOW - 100)  # before `since`: not listed
    store.ban("account", "carol", reason="abuse", now=NOW + 1)
    assert store.revoke_node("n1", now=NOW + 1) == 2
    assert store.revoke_node("n1", now=NOW + 2) == 0
    assert store.revoke_account("bob", now=NOW + 3) == 2
    assert store.live_credentials(now=NOW + 4) == []
    assert store.revoked_since(since=NOW) == (["n1", "n2", "n3"], ["bob", "carol"])
    assert store.revoked_since(since=NOW + 3) == (["n2", "n3"], ["bob"])
    # a revoked credential that is still unexpired stays listed, however long ago it was revoked
    issue(store, "seed", account="operator", lifetime_s=30 * 86400.0)
    store.revoke_node("seed", now=NOW + 5)
    assert "seed" in store.revoked_since(since=NOW + 86400, now=NOW + 86400)[0]
    assert "seed" not in store.revoked_since(since=NOW + 86400, now=NOW + 31 * 86400)[0]


# --- durability ---------------------------------------------------------------------------


def test_credential_and_request_status_survive_reopening(db_url):
    with Store.open(db_url) as store:
        admitted, refused = add_request(store, "n1"), add_request(store, "n2")
        credential = issue(store, request_id=admitted)
        store.set_request(refused, status="refused", reason="software", now=NOW + 1)
    with Store.open(db_url) as store:
        assert store.credential(credential.serial) == credential
        assert store.request(admitted).status == "admitted"
        assert (store.request(refused).status, store.request(refused).reason) == ("refused", "software")
        assert issue(store, "n3").serial > credential.serial
