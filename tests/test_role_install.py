"""What a contributor installs: a role and agora-core, and neither the simulator nor any test
fixture (those live in agora-sim and agora-devkit, which no role depends on)."""

from __future__ import annotations

import json
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LIST_MODULES = """
import json, sys
from importlib import metadata
files = []
for name in sys.argv[1:]:
    files += [str(f) for f in metadata.distribution(name).files or ()]
print(json.dumps(files))
"""


@pytest.mark.slow
def test_a_worker_installed_alone_holds_no_simulator_and_no_test_module(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # --no-deps: what the two distributions themselves ship is the question, not torch (the
    # build backend comes from the package index, as in any pip install of a source tree)
    # Built from copies of the sources: a build writes build/ beside its source, and leftovers
    # there from an older tree would be shipped too (and the checkout stays as it was).
    sources = []
    for name in ("agora-core", "agora-worker"):
        copy = tmp_path / name
        shutil.copytree(ROOT / "packages" / name, copy, ignore=shutil.ignore_patterns("build", "*.egg-info"))
        sources.append(str(copy))
    install = [str(python), "-m", "pip", "install", "--quiet", "--no-deps", *sources]
    done = subprocess.run(install, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    listed = subprocess.run(
        [str(python), "-c", LIST_MODULES, "agora-core", "agora-worker"],
        check=True,
        timeout=60,
        capture_output=True,
        text=True,
    )
    files = [f for f in json.loads(listed.stdout) if f.endswith(".py")]
    modules = [f.removesuffix(".py").replace("/", ".") for f in files]
    assert "agora_core.world" in modules and "agora_worker.worker" in modules  # the real thing
    shipped_dev = [
        m
        for m in modules
        if ".sim." in f".{m}." or "testing" in m or m.split(".")[0] in ("agora_sim", "agora_devkit")
    ]
    assert not shipped_dev, shipped_dev
    assert not any(m.startswith(("tests.", "agora_core.tests", "agora_worker.tests")) for m in modules)
