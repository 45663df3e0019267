"""The world seam holds: the shipped packages read clocks and system randomness only through
``agora_core.world``, so the simulator's virtual world reaches all of their code. Only the
seam itself and the command-line front ends (which run in the real world by definition) may
call ``time.time``, ``time.monotonic`` or ``os.urandom`` directly."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ["agora-core", "agora-worker", "agora-trainer", "agora-authorizer", "agora-monitor"]
BYPASSES = {("time", "time"), ("time", "monotonic"), ("os", "urandom")}


def allowed(path: Path) -> bool:
    """The seam, and the modules that are a command's front end."""
    return path.name in ("world.py", "cli.py", "__main__.py") or path.name.endswith("_cli.py")


def bypasses_in(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in BYPASSES:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in ("time", "os"):
            for alias in node.names:
                if (node.module, alias.name) in BYPASSES:
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
    return found


def test_no_production_module_reads_the_clock_or_urandom_around_the_seam():
    offences = []
    checked = 0
    for package in SHIPPED:
        for path in sorted((ROOT / "packages" / package / "src").rglob("*.py")):
            if allowed(path):
                continue
            checked += 1
            for line, what in bypasses_in(ast.parse(path.read_text(), str(path))):
                offences.append(f"{path.relative_to(ROOT)}:{line}: {what} (use agora_core.world)")
    assert checked > 100  # the packages' modules were found at all
    assert not offences, "\n".join(offences)


def test_the_check_finds_each_kind_of_bypass():
    source = "import os, time\nfrom time import monotonic\nx = time.time()\ny = os.urandom(4)\nz = time.perf_counter()\n"
    assert [what for _, what in bypasses_in(ast.parse(source))] == [
        "from time import monotonic",
        "time.time",
        "os.urandom",
    ]
