"""Run config keys the code does not act on yet; a config that sets one is refused.

Every key of the run config is either read by the code or listed here, and a test
(``packages/agora-core/tests/test_config_honest.py``) walks every field and checks both ways: a key read by
nothing fails it, and so does a listed key the code now reads. A listed key keeps its
default, which is what the code does today (an open run, samples in shard order); a config
that sets it to anything else is refused with the reason, never silently ignored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agora_core.config.loader import coerce, field_types
from agora_core.errors import ConfigError

# dotted key -> what is missing and what brings it
NOT_IMPLEMENTED: dict[str, str] = {}


def field_at(root: type, key: str) -> tuple[type, dataclasses.Field]:
    """The dataclass and field a dotted ``key`` names under ``root``; KeyError if none."""
    cls, *sections, name = [root, *key.split(".")]
    for section in sections:
        cls = field_types(cls)[section]
        if not dataclasses.is_dataclass(cls):
            raise KeyError(key)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return cls, fields[name]


def default_of(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def refuse_not_implemented(root: type, data: Mapping[str, Any]) -> None:
    """ConfigError for the first listed key that ``data`` (a parsed TOML table) sets to
    something other than its default. Runs before the config is built, so the refusal comes
    first, not a check that only matters once the key is implemented."""
    for key, why in NOT_IMPLEMENTED.items():
        *sections, name = key.split(".")
        table: Any = data
        for section in sections:
            table = table.get(section) if isinstance(table, Mapping) else None
        if not isinstance(table, Mapping) or name not in table:
            continue
        cls, f = field_at(root, key)
        value = coerce(field_types(cls)[name], table[name], key)
        default = default_of(f)
        if value != default:
            raise ConfigError(
                key, f"{value!r} is not implemented yet: {why}; leave it out (the default is {default!r})"
            )
