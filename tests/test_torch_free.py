"""The roles that run on any small machine never import torch: a contributor installs the
trainer in seconds, and the authorizer and the monitor run beside a run on a small host."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
for module in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    if module.name != package.__name__ + ".__main__":
        importlib.import_module(module.name)
print(len(list(pkgutil.walk_packages(package.__path__))), "modules;",
      "torch imported" if "torch" in sys.modules else "no torch")
"""


@pytest.mark.parametrize("package", ["agora_trainer", "agora_authorizer", "agora_monitor"])
def test_no_module_of_a_torch_free_role_imports_torch(package):
    result = subprocess.run(
        [sys.executable, "-c", CHECK, package], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("no torch"), result.stdout
