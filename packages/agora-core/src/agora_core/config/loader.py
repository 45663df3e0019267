"""Build typed, frozen config dataclasses from plain data (TOML tables, env strings).

Every value is checked against the field's annotation; unknown keys are refused with the
closest valid spelling; each dataclass's own ``__post_init__`` checks ranges and relations.
Any failure is a :class:`ConfigError` naming the full dotted key.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from agora_core.errors import ConfigError

MiB = 1 << 20


def require(condition: bool, key: str, reason: str) -> None:
    """For ``__post_init__`` checks: raise ConfigError(key, reason) unless ``condition``."""
    if not condition:
        raise ConfigError(key, reason)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a config dataclass (string annotations evaluated)."""
    return typing.get_type_hints(cls)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "absent"
    if dataclasses.is_dataclass(tp):
        return "table"
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any, path: str, *, from_string: bool = False) -> Any:
    """Check ``value`` against annotation ``tp`` and convert where lossless.

    With ``from_string`` (environment variables), strings are parsed into ints, floats, bools
    and comma-separated lists.
    """
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(path, f"expected a table, got {type(value).__name__}")
        return build(tp, value, path)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if type(None) in options and (value is None or (from_string and value == "")):
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return coerce(option, value, path, from_string=from_string)
            except ConfigError as exc:
                errors.append(exc.reason)
        raise ConfigError(path, f"expected {_type_name(tp)}: " + "; ".join(errors))
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if from_string and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {type(value).__name__}")
        item_type = typing.get_args(tp)[0]
        items = [coerce(item_type, v, f"{path}[{i}]", from_string=from_string) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is bool:
        if from_string and isinstance(value, str):
            lowered = value.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
        if not isinstance(value, bool):
            raise ConfigError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if from_string and isinstance(value, str):
            try:
                return int(value.strip().replace("_", ""), 0)
            except ValueError:
                raise ConfigError(path, f"expected an integer, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if from_string and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(path, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"expected a number, got {value!r}")
        return float(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        names = [member.value for member in tp]
        if value not in names:
            raise ConfigError(path, f"must be one of {', '.join(map(repr, names))}, got {value!r}")
        return tp(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"expected a string, got {value!r}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config loader cannot handle annotation {tp!r} at {path}")


def build(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Instantiate dataclass ``cls`` from ``data``; missing keys take their defaults."""
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in data if key not in fields]
    if unknown:
        key = unknown[0]
        moved_to = getattr(cls, "MOVED_KEYS", {}).get(key)
        if moved_to:
            raise ConfigError(_join(path, str(key)), f"this key moved: set {moved_to} instead")
        close = difflib.get_close_matches(str(key), fields, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(fields)}"
        raise ConfigError(_join(path, str(key)), f"unknown key; {hint}")
    kwargs = {name: coerce(hints[name], data[name], _join(path, name)) for name in fields if name in data}
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        if path and not exc.key.startswith(path + "."):
            raise ConfigError(_join(path, exc.key), exc.reason) from None
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(path or cls.__name__, str(exc)) from None
