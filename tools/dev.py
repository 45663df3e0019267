#!/usr/bin/env python3
"""Set up the development environment and run Agora's two quickstart jobs.

    python3 tools/dev.py run     # set up, then run the main job
    python3 tools/dev.py test    # set up, then run the whole test suite (what CI runs)
    python3 tools/dev.py setup   # only set up .venv

Needs nothing but Python 3.11+ with pip. Setup creates ``.venv`` in the repo, installs every
package under ``packages/`` editable plus ``requirements-dev.txt`` in one pip call, and
checks that every ``agora*`` distribution in the environment was installed from this repo
(unrelated projects publish ``agora-core`` and ``agora`` on the package index). Setup is
skipped when nothing it depends on changed since the last run.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = VENV / ".agora-setup-stamp"
PYTHON = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
# where Debian's postgresql package puts initdb and pg_ctl (not on PATH): the authorizer's
# store tests start a throwaway server from there
POSTGRES_BIN_GLOB = "/usr/lib/postgresql/*/bin"
REVIEW_LINES = 600  # a module past this is named for review before the tests run (not a failure)

# Runs inside the venv: every agora* distribution must be an editable/local install whose
# source lies under packages/ of this repo, and every local package must be installed.
_PROVENANCE_CHECK = r"""
import json, sys
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

packages = Path(sys.argv[1]).resolve()
expected = set(sys.argv[2:])
seen, bad = set(), []
for dist in metadata.distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if not name.startswith("agora"):
        continue
    seen.add(name)
    if packages in Path(dist.locate_file("")).resolve().parents:
        continue  # build metadata inside a local package's source tree (src/*.egg-info)
    raw = dist.read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    path = Path(unquote(urlparse(url).path)).resolve() if url.startswith("file:") else None
    if path is None or packages not in (path, *path.parents):
        bad.append(f"{name} {dist.version} came from {url or 'a package index'}, not from {packages}")
missing = sorted(expected - seen)
if missing:
    bad.append("local packages not installed: " + ", ".join(missing))
if bad:
    print("provenance check failed:\n  " + "\n  ".join(bad), file=sys.stderr)
    sys.exit(1)
print(f"provenance: {len(seen)} agora distributions, all from {packages}")
"""


def _say(message: str) -> None:
    print(f"[dev] {message}", flush=True)


def local_packages() -> list[Path]:
    return sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))


def _fingerprint() -> str:
    digest = hashlib.sha256(sys.version.encode())
    for path in [ROOT / "requirements-dev.txt", *(p / "pyproject.toml" for p in local_packages())]:
        digest.update(str(path.relative_to(ROOT)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(cmd: list[str], **kwargs) -> None:
    result = subprocess.run(cmd, cwd=ROOT, **kwargs)
    if result.returncode != 0:
        _say(f"failed ({result.returncode}): {' '.join(map(str, cmd))}")
        sys.exit(result.returncode)


def setup() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - this script runs on whatever python3 is
        sys.exit(f"Agora needs Python 3.11 or newer; this is {sys.version.split()[0]}")
    if not PYTHON.exists():
        _say(f"creating virtual environment {VENV.relative_to(ROOT)}")
        venv.EnvBuilder(with_pip=True, clear=True).create(VENV)
    fingerprint = _fingerprint()
    if not STAMP.exists() or STAMP.read_text() != fingerprint:
        packages = local_packages()
        _say(f"installing {len(packages)} local packages (editable) and dev requirements")
        cmd = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        cmd += ["-r", str(ROOT / "requirements-dev.txt")]
        for package in packages:
            cmd += ["-e", str(package)]
        _run(cmd)
        STAMP.write_text(fingerprint)
    result = check_provenance(PYTHON)
    if result.returncode != 0:
        sys.exit(result.returncode)


def check_provenance(python: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the provenance check with ``python``; it prints what it found or what is wrong."""
    names = [p.name for p in local_packages()]
    return subprocess.run(
        [str(python), "-c", _PROVENANCE_CHECK, str(ROOT / "packages"), *names], cwd=ROOT, env=env
    )


def _postgres_installed() -> bool:
    return shutil.which("initdb") is not None or bool(glob.glob(f"{POSTGRES_BIN_GLOB}/initdb"))


_apt_updated: list[bool] = []


def _apt_install(packages: tuple[str, ...], purpose: str) -> bool:
    """As root, ``apt-get install`` ``packages`` (which ``purpose`` needs); otherwise say what
    to install. False if that did not work."""
    if getattr(os, "geteuid", lambda: -1)() != 0 or shutil.which("apt-get") is None:
        _say(f"{purpose}: install {' and '.join(packages)}")
        _say(f"  Debian/Ubuntu: sudo apt-get install -y {' '.join(packages)}; then rerun")
        return False
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}  # no prompts from the package scripts
    commands = [["apt-get", "install", "-y", *packages]]
    if not _apt_updated:  # once per run, however many packages are missing
        commands.insert(0, ["apt-get", "update"])
        _apt_updated.append(True)
    for command in commands:
        _say(f"{purpose}: {' '.join(command)}")
        if subprocess.run(command, env=env).returncode != 0:
            _say(f"failed: {' '.join(command)}")
            return False
    return True


def ensure_postgres() -> bool:
    """The authorizer's store and the monitor's database are tested on a real PostgreSQL
    server (initdb, pg_ctl): installed with apt when missing. False if it is not there."""
    if _postgres_installed():
        return True
    return _apt_install(("postgresql",), "the tests need a PostgreSQL server") and _postgres_installed()


BROWSER_PACKAGES = ("chromium", "chromium-driver")  # Debian's: the dashboard test's headless browser
BROWSER_FILES = ("/usr/bin/chromium", "/usr/bin/chromedriver")


def _browser_installed() -> bool:
    return all(Path(path).exists() for path in BROWSER_FILES)


def ensure_browser() -> bool:
    """The monitor's dashboard is tested in a real headless Chromium (through Selenium):
    Debian's chromium and chromium-driver, installed with apt when missing. False if they are
    not there."""
    if _browser_installed():
        return True
    return (
        _apt_install(BROWSER_PACKAGES, "the dashboard test needs a headless browser") and _browser_installed()
    )


# What Debian's packages install on PATH (dpkg -L prometheus prometheus-pushgateway): the
# metrics tests lint expositions and alert rules with promtool and push to a real gateway
PROMETHEUS_TOOLS = {"promtool": "prometheus", "prometheus-pushgateway": "prometheus-pushgateway"}


def ensure_prometheus_tools() -> bool:
    """Install the Prometheus packages whose tools are missing with apt. False if a tool is
    still not there."""
    missing = sorted({package for tool, package in PROMETHEUS_TOOLS.items() if shutil.which(tool) is None})
    if not missing:
        return True
    return _apt_install(tuple(missing), "the metrics tests need promtool and a push gateway") and all(
        shutil.which(tool) is not None for tool in PROMETHEUS_TOOLS
    )


def ensure_iproute() -> None:
    """The two-host test makes network namespaces with ``ip`` (iproute2): installed with apt
    when missing and root. Not fatal: without root or ``ip`` that test says why it skips."""
    if shutil.which("ip") is None and getattr(os, "geteuid", lambda: -1)() == 0:
        _apt_install(("iproute2",), "the two-host test makes network namespaces with ip")


def run_tests(extra: list[str]) -> int:
    if not ensure_postgres() or not ensure_prometheus_tools() or not ensure_browser():
        return 1
    ensure_iproute()
    _say("linting (ruff check, ruff format --check)")
    for lint in (["check", "."], ["format", "--check", "."]):
        if subprocess.run([str(PYTHON), "-m", "ruff", *lint], cwd=ROOT).returncode != 0:
            _say("lint failed: run .venv/bin/ruff check --fix . && .venv/bin/ruff format .")
            return 1
    _say("checking the layers (lint-imports: the contracts in pyproject.toml)")
    lint_imports = [
        str(PYTHON),
        "-c",
        "from importlinter.cli import lint_imports_command as c; c()",
        "--no-cache",
    ]
    if subprocess.run(lint_imports, cwd=ROOT, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(lint_imports, cwd=ROOT)  # again, to show what broke
        _say("a layer contract is broken: a module imports one above its layer, or a role another role")
        return 1
    long_modules = [
        f"{path.relative_to(ROOT)} ({lines} lines)"
        for path in sorted(ROOT.glob("packages/*/src/**/*.py"))
        if (lines := len(path.read_text().splitlines())) > REVIEW_LINES
    ]
    if long_modules:  # a module is one concept, as big as it needs; past this, look again
        _say(f"modules past {REVIEW_LINES} lines, for review: " + ", ".join(long_modules))
    _say("running the test suite (in random order: pytest-randomly prints the seed to rerun it with)")
    # --durations: the slowest tests are named in every run, so creeping test time is seen early
    result = subprocess.run([str(PYTHON), "-m", "pytest", "--durations=15", *extra], cwd=ROOT)
    if result.returncode == 5:
        _say("pytest collected no tests: that is a failure")
    return result.returncode


def run_main(extra: list[str]) -> int:
    _say("starting a local swarm: DHT seed, 4 stages x 2 workers, 1 trainer (examples/tiny.toml)")
    swarm = [str(PYTHON), str(ROOT / "tools" / "swarm.py"), "up", "--samples", "4096", *extra]
    try:
        return subprocess.run(swarm, cwd=ROOT).returncode
    except KeyboardInterrupt:  # the swarm stops its processes itself
        return 130


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "test", "setup"):
        print(__doc__.strip())
        return 2
    command, extra = argv[0], argv[1:]
    setup()
    if command == "test":
        return run_tests(extra)
    if command == "run":
        return run_main(extra)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
