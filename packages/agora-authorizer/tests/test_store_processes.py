"""The store across processes: another process writing while it is open, two racing on
nonces, and SIGKILLs mid-write and mid-signing that lose nothing committed (both backends)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys

from agora_authorizer.store import Ban, Store
from agora_devkit.processes import ChildProcess, spawn_python

NOW = 1_700_000_000.0

# A CLI process: opens the database the test's store has open and bans a node.
BAN_SCRIPT = """
import sys
from agora_authorizer.store import Store
with Store.open(sys.argv[1]) as store:
    store.ban("node", "n-evil", reason="from the CLI", now=float(sys.argv[2]))
"""

# Remembers nonces 0..N-1 once the parent says go, racing another copy of itself.
NONCE_SCRIPT = """
import sys
from agora_authorizer.store import Store
with Store.open(sys.argv[1]) as store:
    print("READY", flush=True)
    sys.stdin.readline()
    new = sum(store.remember_nonce(i.to_bytes(16, "big"), now=1.0) for i in range(int(sys.argv[2])))
    print("NEW", new, flush=True)
"""

# Admits node after node, printing each id once the method that made it has returned; given
# an iteration, it SIGKILLs itself there from inside sign(), mid-transaction.
WRITER_SCRIPT = """
import os, signal, sys
from agora_authorizer.store import Store
store = Store.open(sys.argv[1])
die_at = int(sys.argv[2]) if len(sys.argv) > 2 else -1

def sign(serial):
    if i == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return b"body-%d" % serial, b"signature"

print("READY", flush=True)
for i in range(100_000):
    node = f"node-{i}"
    rid = store.add_request(node_id=node, public_key=bytes(32), role="worker", address="127.0.0.1:1",
                            account="alice", hardware={"i": i}, software={}, now=float(i))
    print("REQUEST", rid, flush=True)
    credential = store.issue_credential(request_id=rid, node_id=node, public_key=bytes(32), role="worker",
                                        stage=i % 4, account="alice", issued=float(i), expires=i + 600.0,
                                        sign=sign)
    print("CREDENTIAL", credential.serial, rid, flush=True)
"""


def all_lines(child: ChildProcess) -> list[str]:
    """Every line a child that has exited printed, read to the end of its output."""
    with contextlib.suppress(RuntimeError):  # raised at the end of output: no line starts with NUL
        child.read_until("\0", timeout_s=30)
    return child.lines


# --- two processes ------------------------------------------------------------------------


def test_two_processes_racing_on_nonces_each_win_a_nonce_once(store, db_url):
    count = 100
    with (
        spawn_python(["-c", NONCE_SCRIPT, db_url, str(count)]) as first,
        spawn_python(["-c", NONCE_SCRIPT, db_url, str(count)]) as second,
    ):
        for child in (first, second):
            child.read_until("READY")
        for child in (first, second):
            child.proc.stdin.write(b"go\n")
            child.proc.stdin.flush()
        new = [int(child.read_until("NEW ", timeout_s=120)) for child in (first, second)]
    assert sum(new) == count
    assert not store.remember_nonce((count - 1).to_bytes(16, "big"), now=NOW)


def test_ban_written_by_another_process_is_seen_by_an_open_store(store, db_url):
    assert not store.is_banned("node", "n-evil")
    command = [sys.executable, "-c", BAN_SCRIPT, db_url, str(NOW)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert store.is_banned("node", "n-evil")
    assert store.bans() == [Ban(kind="node", target="n-evil", reason="from the CLI", created=NOW)]


# --- SIGKILL ----------------------------------------------------------------------------------


def test_sigkill_mid_write_loses_no_committed_record(db_url):
    with spawn_python(["-c", WRITER_SCRIPT, db_url]) as child:
        child.read_until("READY", timeout_s=60)
        for _ in range(20):
            child.read_until("CREDENTIAL ", timeout_s=60)
        child.kill()
        child.proc.stdin.close()  # spawn_python closes it only for a child still running
        lines = all_lines(child)
    requests = [int(line.split()[1]) for line in lines if line.startswith("REQUEST ")]
    credentials = [tuple(map(int, line.split()[1:])) for line in lines if line.startswith("CREDENTIAL ")]
    assert len(credentials) >= 20
    with Store.open(db_url) as store:
        assert all(store.request(rid) is not None for rid in requests)
        for serial, rid in credentials:
            credential = store.credential(serial)
            assert (credential.request_id, credential.body) == (rid, b"body-%d" % serial)
            assert store.request(rid).status == "admitted"
        # all or nothing: a request is admitted exactly when its credential committed
        for rid in range(1, max(requests) + 3):  # ids the child committed but did not print too
            request = store.request(rid)
            if request is not None:
                credential = store.latest_credential_of(request.node_id)
                assert (request.status == "admitted") == (credential is not None)
        after = store.add_request(
            node_id="after-the-crash",
            public_key=bytes(32),
            role="worker",
            address="127.0.0.1:1",
            account="alice",
            hardware={},
            software={},
            now=NOW,
        )
        assert after > max(requests)  # the store goes on numbering past what the child committed


def test_sigkill_while_signing_commits_neither_credential_nor_admission(db_url):
    with spawn_python(["-c", WRITER_SCRIPT, db_url, "3"]) as child:
        assert child.proc.wait(timeout=60) == -signal.SIGKILL
        child.proc.stdin.close()
        lines = all_lines(child)
    assert [line.split()[0] for line in lines] == ["READY"] + ["REQUEST", "CREDENTIAL"] * 3 + ["REQUEST"]
    requests = [int(line.split()[1]) for line in lines if line.startswith("REQUEST ")]
    with Store.open(db_url) as store:
        assert [store.request(rid).status for rid in requests] == ["admitted"] * 3 + ["checking"]
        assert store.latest_credential_of("node-3") is None
        live = store.live_credentials(now=0.0)
        assert [credential.node_id for credential in live] == ["node-0", "node-1", "node-2"]
