"""Config dataclasses back to TOML text: what a checkpoint or an exported model carries, so it
says by itself which run (and which model) it belongs to.

``parse_run_config(dump_toml(run)) == run`` for every valid run config. Fields that are None
are left out (they read back as their default, which for every such field is None).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from typing import Any


def dump_toml(config: Any) -> str:
    """TOML text of a config dataclass: its scalar fields, then one table per nested config."""
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        raise TypeError(f"dump_toml takes a config dataclass instance, not {type(config).__name__}")
    lines: list[str] = []
    _table(config, "", lines)
    return "\n".join(lines).strip() + "\n"


def _table(config: Any, path: str, lines: list[str]) -> None:
    nested = []
    if path:
        lines += ["", f"[{path}]"]
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if dataclasses.is_dataclass(value):
            nested.append((field.name, value))
        elif value is not None:
            lines.append(f"{field.name} = {toml_value(value, f'{path}.{field.name}'.lstrip('.'))}")
    for name, value in nested:
        _table(value, f"{path}.{name}" if path else name, lines)


def toml_value(value: Any, key: str = "") -> str:
    """One TOML value: a scalar, an enum's value, or a list of them (``key`` names it in errors)."""
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # shortest text that reads back as the same float
    if isinstance(value, str):
        return json.dumps(value)  # JSON's escapes are all valid in a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v, key) for v in value) + "]"
    raise TypeError(f"{key}: cannot write a {type(value).__name__} as TOML")
