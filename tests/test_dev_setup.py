"""The dev setup refuses agora* distributions that did not come from this repo."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dev():
    spec = importlib.util.spec_from_file_location("agora_dev_tool", ROOT / "tools" / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_distribution(site: Path, name: str, url: str | None) -> None:
    """A dist-info as pip leaves it: METADATA, and direct_url.json for non-index installs."""
    info = site / f"{name.replace('-', '_')}-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 9.9.9\n")
    if url is not None:
        (info / "direct_url.json").write_text(json.dumps({"url": url, "dir_info": {"editable": True}}))


def run_check(dev, site: Path | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    result = dev.check_provenance(Path(sys.executable), env=env)
    return result


def test_this_environment_passes(dev):
    assert run_check(dev, None).returncode == 0


def test_a_distribution_from_the_index_fails_the_check(dev, tmp_path, capfd):
    fake_distribution(tmp_path, "agora", url=None)  # what `pip install agora` would leave
    assert run_check(dev, tmp_path).returncode == 1
    assert "agora 9.9.9 came from a package index" in capfd.readouterr().err


def test_a_local_install_from_elsewhere_fails_the_check(dev, tmp_path, capfd):
    fake_distribution(tmp_path, "agora-extras", url=f"file://{tmp_path}/elsewhere")
    assert run_check(dev, tmp_path).returncode == 1
    assert "not from" in capfd.readouterr().err
