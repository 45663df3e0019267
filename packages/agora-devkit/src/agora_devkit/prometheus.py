"""The Prometheus tools in Agora's tests: a real push gateway process, and promtool.

``tools/dev.py test`` installs Debian's ``prometheus`` (promtool) and
``prometheus-pushgateway`` when they are missing. :func:`pushgateway_process` starts a gateway on
a free loopback port, in memory only, and stops it when the block exits whatever happened;
:class:`PushGateway` reads back what nodes pushed. :func:`check_metrics` runs
``promtool check metrics`` on an exposition.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

PROMTOOL = "promtool"  # from Debian's prometheus package (/usr/bin/promtool)
PUSHGATEWAY = "prometheus-pushgateway"  # Debian's name for the pushgateway binary (/usr/bin)
START_TIMEOUT_S = 10.0


def require_tool(name: str) -> str:
    """The path of Prometheus tool ``name``; FileNotFoundError saying how to get it."""
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(
            f"{name} is not installed: `python3 tools/dev.py test` installs it as root, or "
            "apt-get install -y prometheus prometheus-pushgateway"
        )
    return path


def promtool(*args: str, stdin: bytes | None = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    """``promtool args...`` (its output as text in ``stdout``, stderr merged into it)."""
    return subprocess.run(
        [require_tool(PROMTOOL), *args],
        input=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout_s,
        check=False,
    )


def check_metrics(exposition: bytes) -> str:
    """``promtool check metrics`` on a text exposition: "" if it passed, else what it said.
    promtool exits 1 for lint problems (names, units, help) as well as for parse errors."""
    result = promtool("check", "metrics", stdin=exposition)
    return (
        ""
        if result.returncode == 0
        else result.stdout.decode(errors="replace") or f"exit {result.returncode}"
    )


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass(frozen=True)
class Group:
    """One group on a gateway: its grouping labels and its metrics (name -> samples, each
    ``(labels, value)``)."""

    labels: dict[str, str]
    metrics: dict[str, list[tuple[dict[str, str], float]]]

    def value(self, name: str, **labels: str) -> float | None:
        """The value of the sample of ``name`` whose labels include ``labels`` (None: none)."""
        for sample_labels, value in self.metrics.get(name, []):
            if labels.items() <= sample_labels.items():
                return value
        return None


class PushGateway:
    """A push gateway's HTTP API, as tests read it."""

    def __init__(self, address: str):
        self.address = address  # host:port, what AGORA_METRICS_PUSH_GATEWAY takes

    def groups(self) -> list[Group]:
        """Every group the gateway holds now (its ``/api/v1/metrics``)."""
        with urllib.request.urlopen(f"http://{self.address}/api/v1/metrics", timeout=5) as response:
            data = json.load(response)["data"]
        groups = []
        for entry in data:
            metrics = {
                name: [(m["labels"], float(m["value"])) for m in family.get("metrics", []) if "value" in m]
                for name, family in entry.items()
                if isinstance(family, dict) and "metrics" in family
            }
            groups.append(Group(labels=entry["labels"], metrics=metrics))
        return groups

    def group(self, **labels: str) -> Group | None:
        """The group whose grouping labels include ``labels``, if the gateway holds one."""
        for group in self.groups():
            if labels.items() <= group.labels.items():
                return group
        return None

    def exposition(self) -> bytes:
        """What Prometheus scrapes from the gateway."""
        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as response:
            return response.read()

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=1) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False


@contextlib.contextmanager
def pushgateway_process() -> Iterator[PushGateway]:
    """A real ``prometheus-pushgateway`` on a free 127.0.0.1 port, keeping nothing on disk;
    stopped (SIGTERM, then SIGKILL) when the block exits, however it exits."""
    address = f"127.0.0.1:{free_loopback_port()}"
    proc = subprocess.Popen(
        [
            require_tool(PUSHGATEWAY),
            f"--web.listen-address={address}",
            "--persistence.file=",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        gateway = PushGateway(address)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not gateway.ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{PUSHGATEWAY} exited ({proc.returncode}): {proc.stderr.read().decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{PUSHGATEWAY} not ready on {address} after {START_TIMEOUT_S:g} s")
            time.sleep(0.02)
        yield gateway
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stderr.close()
