"""Settings files: TOML under the command's flag names, read against the settings classes and written back.

    values = read_config("run.toml", [TrainConfig, LaunchConfig])   # {"batch_size": 128, "lr": 0.05, ...}
    text = to_toml({"batch_size": 128, "lr": 0.05})                  # 'batch-size = 128\\nlr = 0.05\\n'

A key is a setting's flag without its dashes (``batch-size`` for ``--batch-size``); ``batch_size`` is taken too.
A value has the setting's type (``1`` for a float setting is taken as ``1.0``; a two-number setting is a list
of two numbers; a setting that takes words is a list of strings); a setting left out keeps its default or the
command line's value. Every problem is one :class:`~paratrain.errors.ConfigError` naming the file, the key and
what is allowed, raised before anything runs: an unreadable file, TOML that does not parse, an unknown key, a
wrong type, a value the setting's check refuses. :func:`to_toml` writes what :func:`read_config` reads back to
the same values (settings that are not set, ``None``, are left out: their default is ``None``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from paratrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # the same parser, before the standard library took it in (a dependency on Python 3.10 only)
    import tomli as tomllib  # type: ignore[import-not-found, no-redef, unused-ignore]

__all__ = ["key_of", "read_config", "to_toml"]


def key_of(name: str) -> str:
    """The key of a field in a settings file: its flag without the dashes, ``batch_size`` -> ``batch-size``."""
    return name.replace("_", "-")


def read_config(path: str | Path, classes: Sequence[type]) -> dict[str, Any]:
    """The settings ``path`` gives, by field name, typed and checked one by one against ``classes``' fields.

    Raises:
        ConfigError: naming the file, the key and what is allowed (see the module docstring).
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"--config {source}: cannot read it ({exc.strerror or exc}); give the path of a TOML settings file"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--config {source}: not UTF-8 text ({exc.reason}); give a TOML settings file") from exc
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {source}: not valid TOML ({exc}); see https://toml.io for the format") from exc
    fields: dict[str, tuple[dataclasses.Field[Any], Any]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields.setdefault(f.name, (f, hints[f.name]))
    values: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            raise ConfigError(_unknown(source, key, value, fields))
        if name in values:
            raise ConfigError(f"{source}: {key!r} sets {key_of(name)!r} a second time; keep one of them")
        f, hint = fields[name]
        try:
            converted = _typed(value, hint)
        except _WrongType as wrong:
            raise ConfigError(
                f"{source}: {key} must be {wrong.expected}; found {_shown(value)} ({_toml_type(value)})"
            ) from None
        check = f.metadata.get("check")
        expected = check(converted) if check is not None else None
        if expected is not None:
            raise ConfigError(f"{source}: {key} must be {expected}; found {_shown(value)}")
        values[name] = converted
    return values


def to_toml(values: Mapping[str, Any], *, header: str = "") -> str:
    """``values`` (by field name) as TOML under their keys, in the order given; ``None`` values are left out.

    ``header`` becomes comment lines at the top.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    for name, value in values.items():
        if value is not None:
            lines.append(f"{key_of(name)} = {_value(value)}")
    return "\n".join(lines) + "\n"


# -- reading ------------------------------------------------------------------------------------------------------


class _WrongType(Exception):
    def __init__(self, expected: str) -> None:
        super().__init__(expected)
        self.expected = expected


def _unknown(source: str, key: str, value: Any, fields: Mapping[str, Any]) -> str:
    if isinstance(value, dict):
        return f"{source}: [{key}] is a table; settings files are flat: one key per flag, such as batch-size = 64"
    keys = sorted(key_of(name) for name in fields)
    close = difflib.get_close_matches(key_of(key), keys, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return (
        f"{source}: unknown setting {key!r}; {hint}the keys are the command's flags without dashes: {', '.join(keys)}"
    )


def _typed(value: Any, hint: Any) -> Any:
    """``value`` as the type ``hint`` says, or _WrongType naming what was expected."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        for option in options:
            try:
                return _typed(value, option)
            except _WrongType:
                continue
        raise _WrongType(" or ".join(_expected(option) for option in options))
    origin = typing.get_origin(hint)
    if origin is tuple:
        items = typing.get_args(hint)
        if not isinstance(value, list) or len(value) != len(items):
            raise _WrongType(_expected(hint))
        return tuple(_typed(v, item) for v, item in zip(value, items, strict=True))
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise _WrongType(_expected(hint))
        return [_typed(v, item) for v in value]
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    else:
        raise TypeError(f"settings files cannot hold a setting of type {hint}")
    raise _WrongType(_expected(hint))


def _expected(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is tuple:
        items = typing.get_args(hint)
        return f"a list of {len(items)} {'numbers' if all(i in (int, float) for i in items) else 'values'}"
    if origin is list:
        return 'a list of strings, such as ["a", "b"]'
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string (in quotes)"}.get(
        hint, str(hint)
    )


def _toml_type(value: Any) -> str:
    for kind, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string")):
        if isinstance(value, kind):
            return name
    return "a list" if isinstance(value, list) else type(value).__name__


def _shown(value: Any) -> str:
    return _value(value) if isinstance(value, (bool, int, float, str, list)) else repr(value)


# -- writing ------------------------------------------------------------------------------------------------------


def _escaped(char: str) -> str:
    """One character inside a TOML basic string: quotes, backslashes and control characters escaped."""
    if char in _ESCAPES:
        return _ESCAPES[char]
    return char if " " <= char != "\x7f" else f"\\u{ord(char):04x}"


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # the shortest text that reads back as the same float: 0.01, 1e-05, 3.0
    if isinstance(value, str):
        return '"' + "".join(_escaped(c) for c in value) + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write a {type(value).__name__} to a settings file: {value!r}")
