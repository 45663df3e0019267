"""A monitor runs on any small machine: no module of it may import torch."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import agora_monitor
for module in pkgutil.walk_packages(agora_monitor.__path__, "agora_monitor."):
    if module.name != "agora_monitor.__main__":
        importlib.import_module(module.name)
print(len(list(pkgutil.walk_packages(agora_monitor.__path__))), "modules;",
      "torch imported" if "torch" in sys.modules else "no torch")
"""


def test_no_monitor_module_imports_torch():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("no torch"), result.stdout
