"""What software a node runs: each agora package's version and a digest of its sources.

The digest is SHA-256 over every ``.py`` file of the installed package, in path order, each
as its relative path, a NUL, its length and its bytes: a changed, added or removed file
changes it, and so does a file moved. The authorizer compares it with the run's allowed list
(the integrity check). A node that lies about its digest can only be caught by code it does
not control; the check keeps honest contributors on a known build and stops accidental
drift, as in the reference run.
"""

from __future__ import annotations

import hashlib
import importlib.util
from importlib import metadata
from pathlib import Path

from agora_core.errors import AgoraError

# import name -> distribution name, for the packages a role's report covers
PACKAGES = {
    "agora_core": "agora-core",
    "agora_worker": "agora-worker",
    "agora_trainer": "agora-trainer",
    "agora_authorizer": "agora-authorizer",
    "agora_monitor": "agora-monitor",
}
ROLE_PACKAGES = {
    "worker": ("agora_core", "agora_worker"),
    "trainer": ("agora_core", "agora_trainer"),
    "monitor": ("agora_core", "agora_monitor"),
}


class SoftwareError(AgoraError):
    """A package a report needs is not installed."""


def package_directory(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise SoftwareError(f"package {module} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def source_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*.py") if "__pycache__" not in p.parts):
        data = path.read_bytes()
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(b"\0" + len(data).to_bytes(8, "big"))
        digest.update(data)
    return digest.hexdigest()


def package_report(module: str) -> dict[str, str]:
    """``{version, digest}`` of installed package ``module`` (an import name)."""
    directory = package_directory(module)
    try:
        version = metadata.version(PACKAGES.get(module, module))
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {"version": version, "digest": source_digest(directory)}


def software_report(role: str) -> dict[str, dict[str, str]]:
    """The report a node of ``role`` sends: its packages' versions and digests, by
    distribution name."""
    return {PACKAGES[module]: package_report(module) for module in ROLE_PACKAGES[role]}


def allowed_entry(name: str, report: dict[str, str]) -> str:
    """One entry of ``[admission] allowed_software``: ``"agora-core 0.1.0 <digest>"``."""
    return f"{name} {report['version']} {report['digest']}"


def parse_allowed(entries: list[str] | tuple[str, ...]) -> dict[str, set[tuple[str, str]]]:
    """``[admission] allowed_software`` as distribution name -> {(version, digest)}.
    A digest of ``*`` allows any source of that version."""
    allowed: dict[str, set[tuple[str, str]]] = {}
    for entry in entries:
        name, version, digest = entry.split()
        allowed.setdefault(name, set()).add((version, digest))
    return allowed


def local_build(modules: tuple[str, ...] = tuple(PACKAGES)) -> list[str]:
    """Allowed-list entries for the agora packages installed here (those that are)."""
    entries = []
    for module in modules:
        if importlib.util.find_spec(module) is not None:
            entries.append(allowed_entry(PACKAGES[module], package_report(module)))
    return entries
