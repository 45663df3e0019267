"""The store's accusation records, bans on accusations and pardons, on both backends (a fresh
SQLite file and a fresh PostgreSQL database, the ``db_url`` fixture), and the upgrade of a
database written before they existed."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from agora_authorizer.store import Store, parse_url, schema
from agora_core.admission.accusations import Accusation, AccuserRecord, Evidence

NOW = 1_700_000_000.0


def entry(accuser: str, *accused: str, at: float = NOW, kind: str = "averaging_values", rounds: int = 3):
    evidence = (Evidence(round=7, slice=1, chunk=3, measured=2.5, radius=0.5),)
    accusations = tuple(Accusation(a, kind, rounds=rounds, at=at, evidence=evidence) for a in accused)
    return AccuserRecord(accuser, 1, accusations, at)


def issue(store: Store, node_id: str, *, account: str, stage: int | None = 1, expires: float = NOW + 600):
    return store.issue_credential(
        request_id=None,
        node_id=node_id,
        public_key=bytes(32),
        role="worker",
        stage=stage,
        account=account,
        issued=NOW - 60,
        expires=expires,
        sign=lambda serial: (b"body-%d" % serial, b"signature"),
    )


def test_accusations_are_recorded_once_per_accuser_accused_and_kind(store):
    new = store.record_accusations([entry("a", "x", "y"), entry("b", "x")], now=NOW)
    assert sorted((r.accuser, r.accused) for r in new) == [("a", "x"), ("a", "y"), ("b", "x")]
    assert new[0].evidence == [{"round": 7, "slice": 1, "chunk": 3, "measured": 2.5, "radius": 0.5}]
    # read again unchanged, later: nothing new, first_seen and at_seen kept, last_seen moved
    assert store.record_accusations([entry("a", "x", "y")], now=NOW + 5) == []
    [row] = store.docket(accused="y").accusations
    assert (row.first_seen, row.at_seen, row.last_seen) == (NOW, NOW, NOW + 5)
    # a newer round: at and rounds move, and at_seen with them; another kind is a new accusation
    store.record_accusations([entry("a", "y", at=NOW + 8, rounds=4)], now=NOW + 10)
    [row] = store.docket(accused="y").accusations
    assert (row.rounds, row.at, row.at_seen, row.first_seen) == (4, NOW + 8, NOW + 10, NOW)
    new = store.record_accusations([entry("a", "y", kind="averaging_weight")], now=NOW + 11)
    assert [(r.kind, r.accused) for r in new] == [("averaging_weight", "y")]
    assert len(store.docket().accusations) == 4


def test_an_accusation_made_by_a_clock_running_ahead_dates_from_when_it_was_read(store):
    store.record_accusations([entry("a", "x", at=NOW + 3600)], now=NOW)
    [row] = store.docket().accusations
    assert row.made == NOW
    store.record_accusations([entry("a", "x", at=NOW - 30)], now=NOW + 1)
    assert store.docket().accusations[0].made == NOW - 30


def test_an_entry_naming_one_accusation_twice_keeps_the_newest(store):
    record = AccuserRecord(
        "a",
        1,
        (Accusation("x", "averaging_values", 2, NOW + 1), Accusation("x", "averaging_values", 5, NOW + 2)),
        NOW,
    )
    [new] = store.record_accusations([record], now=NOW)
    assert (new.rounds, new.at) == (5, NOW + 2)


def test_the_docket_names_credentials_pardons_and_leaves_out_the_banned(store):
    issue(store, "a", account="alice")
    issue(store, "x", account="xavier")
    issue(store, "x", account="xavier", stage=0)  # the newest is the one named
    store.record_accusations([entry("a", "x", "y"), entry("gone", "x")], now=NOW)
    docket = store.docket()
    assert len(docket.accusations) == 3
    assert set(docket.credentials) == {"a", "x"} and docket.credentials["x"].stage == 0
    store.ban("node", "y", reason="test", now=NOW)
    assert {a.accused for a in store.docket().accusations} == {"x"}
    with_banned = store.docket(with_banned=True)
    assert with_banned.banned == {"y"} and len(with_banned.accusations) == 3
    # live_at: only accusers holding a credential live then ("gone" holds none)
    assert {a.accuser for a in store.docket(live_at=NOW).accusations} == {"a"}
    assert store.docket(live_at=NOW + 3600).accusations == ()


def test_ban_accused_bans_and_revokes_once_and_never_past_a_newer_pardon(store):
    issue(store, "x", account="xavier")
    assert store.ban_accused("x", reason="accused", pardoned=None, now=NOW) == 1
    assert store.is_banned("node", "x") and store.latest_credential_of("x").revoked == NOW
    assert store.ban_accused("x", reason="again", pardoned=None, now=NOW + 1) is None
    assert [b.reason for b in store.bans()] == ["accused"]
    store.record_accusations([entry("a", "x")], now=NOW)
    pardon = store.pardon("x", now=NOW + 2)
    # a judge that read the docket before the pardon bans nobody
    assert store.ban_accused("x", reason="stale", pardoned=None, now=NOW + 3) is None
    assert not store.is_banned("node", "x")
    assert store.ban_accused("x", reason="fresh", pardoned=pardon.pardoned, now=NOW + 4) == 0


def test_pardon_lifts_the_ban_and_forgives_what_was_made_before_it(store):
    issue(store, "x", account="xavier")
    store.record_accusations([entry("a", "x"), entry("b", "x")], now=NOW + 1)
    store.ban_accused("x", reason="accused of it", pardoned=None, now=NOW + 2)
    done = store.pardon("x", now=NOW + 3)
    assert (done.ban_reason, done.forgiven, done.pardoned) == ("accused of it", 2, NOW + 3)
    assert not store.is_banned("node", "x")
    assert store.docket().pardons == {"x": NOW + 3}
    # nothing since: nothing to pardon, nothing recorded
    again = store.pardon("x", now=NOW + 4)
    assert (again.ban_reason, again.forgiven, again.pardoned) == (None, 0, None)
    assert store.docket().pardons == {"x": NOW + 3}
    # a fresh accusation after it: pardoned again, though not banned
    store.record_accusations([entry("a", "x", at=NOW + 5)], now=NOW + 6)
    assert store.pardon("x", now=NOW + 7).forgiven == 1
    assert store.pardon("never-accused", now=NOW).pardoned is None


def test_a_pardon_is_never_earlier_than_an_accusation_already_read(store):
    """The CLI's clock may lag the service's: the pardon still covers what was recorded."""
    store.record_accusations([entry("a", "x")], now=NOW + 100)
    assert store.pardon("x", now=NOW).pardoned == NOW + 100


def test_a_database_written_before_accusations_is_upgraded_keeping_its_rows(db_url):
    with Store.open(db_url) as store:
        store.add_account("alice", "token", now=NOW)
        store.ban("node", "n1", reason="old", now=NOW)
    engine = sa.create_engine(parse_url(db_url)[0])
    try:
        with engine.begin() as connection:  # what version 1 wrote
            schema.accusations.drop(connection)
            schema.pardons.drop(connection)
            connection.execute(sa.update(schema.schema_info).values(version=1))
        with Store.open(db_url) as store:
            assert [a.name for a in store.accounts()] == ["alice"] and store.is_banned("node", "n1")
            store.record_accusations([entry("a", "x")], now=NOW)
            assert store.pardon("x", now=NOW + 1).forgiven == 1
        with engine.connect() as connection:
            assert connection.scalars(sa.select(schema.schema_info.c.version)).all() == [
                schema.SCHEMA_VERSION
            ]
    finally:
        engine.dispose()


@pytest.mark.parametrize("bad", ["", None])
def test_pardon_and_ban_accused_refuse_a_missing_node_id(store, bad):
    with pytest.raises(ValueError, match="node id"):
        store.pardon(bad, now=NOW)
    with pytest.raises(ValueError, match="node id"):
        store.ban_accused(bad, reason="r", pardoned=None, now=NOW)
