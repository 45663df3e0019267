"""A contributor installs the trainer in seconds: it must never import torch."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import agora_trainer
for module in pkgutil.walk_packages(agora_trainer.__path__, "agora_trainer."):
    if module.name != "agora_trainer.__main__":
        importlib.import_module(module.name)
print(len(list(pkgutil.walk_packages(agora_trainer.__path__))), "modules;",
      "torch imported" if "torch" in sys.modules else "no torch")
"""


def test_no_trainer_module_imports_torch():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("no torch"), result.stdout
