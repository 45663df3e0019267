"""The checkout of the Agora repository a local swarm runs from.

The main job needs what only a checkout holds: the example run config, the tools that make
shards, export the model, evaluate it and train the centralized reference, and the folders
for shards and runs. The checkout is ``$AGORA_CHECKOUT`` when set, else the first of the
working directory and its parents, then this package's own folder and its parents (an
editable install from the checkout), that holds ``examples/tiny.toml`` and ``tools/``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click


def _is_checkout(folder: Path) -> bool:
    return (folder / "examples" / "tiny.toml").is_file() and (folder / "tools" / "make_shards.py").is_file()


@functools.cache
def root() -> Path:
    """The checkout's root folder; a usage error when none is found."""
    given = os.environ.get("AGORA_CHECKOUT")
    if given:
        if not _is_checkout(Path(given)):
            raise click.UsageError(f"AGORA_CHECKOUT={given} is not a checkout of the Agora repository")
        return Path(given).resolve()
    here = Path.cwd().resolve()
    for folder in (here, *here.parents, *Path(__file__).resolve().parents):
        if _is_checkout(folder):
            return folder
    raise click.UsageError(
        "a local swarm runs from a checkout of the Agora repository: run it there, or set AGORA_CHECKOUT"
    )


def example_config() -> Path:
    return root() / "examples" / "tiny.toml"


def default_run_dir() -> Path:
    return root() / "runs" / "latest"


def shards_root() -> Path:
    """Where the main job keeps its shard sets, one folder per tokenizer."""
    return root() / ".agora" / "shards"


def tool(name: str, *args: str) -> list[str]:
    """The command line that runs the checkout's ``tools/<name>`` with this interpreter."""
    return [sys.executable, str(root() / "tools" / name), *args]
