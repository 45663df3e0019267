"""Two hosts on one machine, for tests: Linux network namespaces joined by a veth pair.

Each namespace has its own network stack: its own loopback, and one end of the veth with an
address the test assigns (``HOST_A`` and ``HOST_B``, a private /30 that exists only between
the two namespaces, so nothing leaves the machine). A process started in one namespace
reaches the other only through the veth, as a node on another machine would: a node that
advertises 127.0.0.1, or binds only loopback, cannot be reached from the other host.

Needs root and a kernel that allows network namespaces; :func:`two_hosts` raises
:class:`HostsUnavailable` saying which is missing, so a test can say so plainly.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

HOST_A = "10.213.0.1"
HOST_B = "10.213.0.2"
PREFIX_LEN = 30
IP_TIMEOUT_S = 30.0


class HostsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no ``ip``, or the kernel refuses)."""


@dataclass
class Host:
    namespace: str
    address: str  # its veth end's address: what other hosts dial
    processes: list[subprocess.Popen] = field(default_factory=list)

    def spawn(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start ``python ARGS`` in this host's namespace, its output appended to ``log_path``;
        stopped by :func:`two_hosts` on exit if the test has not stopped it."""
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, sys.executable, *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.processes.append(proc)
        return proc


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)


def _stop(processes: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM every process still running (clean exits), SIGKILL what remains after ``timeout_s``."""
    live = [p for p in processes if p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    for proc in live:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


@contextlib.contextmanager
def two_hosts(tag: str | None = None) -> Iterator[tuple[Host, Host]]:
    """Two namespaces joined by a veth pair, each with loopback up; on exit every process
    started on them is stopped and both namespaces are deleted (with them the veth)."""
    if os.geteuid() != 0:
        raise HostsUnavailable(f"network namespaces need root; this test runs as uid {os.geteuid()}")
    if shutil.which("ip") is None:
        raise HostsUnavailable("no `ip` command (the iproute2 package; `tools/dev.py test` installs it)")
    tag = tag or str(os.getpid())
    a, b = Host(f"agora-{tag}-a", HOST_A), Host(f"agora-{tag}-b", HOST_B)
    veth_a, veth_b = f"ag{tag[-8:]}a", f"ag{tag[-8:]}b"  # interface names: 15 characters at most
    made: list[str] = []
    try:
        for host in (a, b):
            done = _ip("netns", "add", host.namespace)
            if done.returncode != 0:
                raise HostsUnavailable(f"the kernel refused a network namespace: {done.stderr.strip()}")
            made.append(host.namespace)
        steps = [
            ("link", "add", veth_a, "type", "veth", "peer", "name", veth_b),
            ("link", "set", veth_a, "netns", a.namespace),
            ("link", "set", veth_b, "netns", b.namespace),
        ]
        for host, veth in ((a, veth_a), (b, veth_b)):
            steps += [
                ("-n", host.namespace, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", veth),
                ("-n", host.namespace, "link", "set", veth, "up"),
                ("-n", host.namespace, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                raise HostsUnavailable(f"`ip {' '.join(step)}` failed: {done.stderr.strip()}")
        yield a, b
    finally:
        _stop(a.processes + b.processes)
        for namespace in made:
            _ip("netns", "delete", namespace)
