"""Each package README's module map is true: it names every module and subpackage of the
package's source tree, and nothing that is not there.

A map is the fenced block that starts with ``src/<import name>/``: one entry per line,
indented two spaces per level (``name.py`` or ``name/``, several entries of one concept
separated by commas), then two spaces and a description. Modules named in parentheses in a
description (``config/  the run config (run.py; node.py)``) belong to that entry's folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
ENTRY = re.compile(r"^(?P<names>[\w.]+/?(?:,\s*[\w.]+/?)*)(?:\s{2,}(?P<text>.*))?$")
MENTION = re.compile(r"\b([\w]+\.py)\b")


def map_block(readme: str, import_name: str) -> list[str] | None:
    """The map's lines after its first (``src/<import name>/``), or None without one."""
    lines = readme.splitlines()
    head = f"src/{import_name}/"
    for i, line in enumerate(lines):
        if line.strip() == head:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            return lines[i + 1 : end]
    return None


def mapped_paths(block: list[str]) -> set[str]:
    """Every module and folder the map names, as paths relative to the package's source."""
    paths: set[str] = set()
    folders: list[str] = []  # the folder of each depth, outermost first
    owner = ""  # where modules mentioned in the last entry's description belong
    for line in block:
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        if depth > len(folders):  # a description wrapped onto the next line
            paths.update(f"{owner}/{m}".lstrip("/") for m in MENTION.findall(line))
            continue
        match = ENTRY.match(line.strip())
        if depth < 0 or match is None:
            raise AssertionError(f"not a map entry: {line!r}")
        folders = folders[:depth]
        here = "/".join(folders)
        names = [n.strip() for n in match["names"].split(",")]
        for name in names:
            paths.add(f"{here}/{name}".lstrip("/").rstrip("/"))
        owner = f"{here}/{names[0]}".lstrip("/").rstrip("/") if names[0].endswith("/") else here
        for mentioned in MENTION.findall(match["text"] or ""):
            paths.add(f"{owner}/{mentioned}".lstrip("/"))
        if names[-1].endswith("/"):
            folders.append(names[-1].rstrip("/"))
    return paths


def tree_paths(source: Path) -> set[str]:
    paths = set()
    for path in source.rglob("*.py"):
        relative = path.relative_to(source)
        if path.name in ("__init__.py", "__main__.py") or any(
            p.endswith(".egg-info") for p in relative.parts
        ):
            continue
        paths.add(relative.as_posix())
        paths.update(parent.as_posix() for parent in relative.parents if parent.as_posix() != ".")
    return paths


@pytest.mark.parametrize("package", PACKAGES, ids=[p.name for p in PACKAGES])
def test_the_readme_maps_every_module_and_only_those(package):
    sources = [p for p in (package / "src").iterdir() if p.is_dir() and not p.name.endswith(".egg-info")]
    assert len(sources) == 1, sources
    source = sources[0]
    block = map_block((package / "README.md").read_text(), source.name)
    assert block is not None, (
        f"{package.name}/README.md has no module map (a block starting src/{source.name}/)"
    )
    mapped, tree = mapped_paths(block), tree_paths(source)
    assert not tree - mapped, f"in the tree, not in the map: {sorted(tree - mapped)}"
    assert not mapped - tree, f"in the map, not in the tree: {sorted(mapped - tree)}"


def test_the_parser_reads_nesting_lists_and_mentions():
    block = [
        "  cli.py, node_cli.py  the commands",
        "  rpc/",
        "    server.py        the server",
        "    deep/",
        "      leaf.py        a leaf",
        "  config/           the run config (run.py;",
        "                    lifecycle.py)",
        "  world.py          the seam",
    ]
    assert mapped_paths(block) == {
        "cli.py",
        "node_cli.py",
        "rpc",
        "rpc/server.py",
        "rpc/deep",
        "rpc/deep/leaf.py",
        "config",
        "config/run.py",
        "config/lifecycle.py",
        "world.py",
    }
