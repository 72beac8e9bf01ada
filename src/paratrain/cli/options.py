"""Command-line options generated from a settings dataclass, so a flag cannot drift from its field.

    add_options(parser, TrainConfig)            # --batch-size for batch_size, with its default, help and choices
    config = from_args(TrainConfig, args)

Each field becomes ``--field-name``. Its type gives the parsing (``int``, ``float``, ``str``; ``X | None`` is
optional; ``bool`` a switch, ``bool | None`` a ``--x/--no-x`` pair; ``tuple[float, float]`` two numbers with a
comma; ``list[str]`` words, with ``nargs``); its metadata gives ``help`` and any of argparse's ``choices``,
``metavar``, ``nargs`` and ``const``; a field of another type gets its parser from the caller. Ranges are not
checked here: each field's check (:meth:`paratrain.settings.Settings.check`) is the one place for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import operator
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from paratrain.settings import flag_of

__all__ = ["add_options", "from_args"]

T = TypeVar("T")
_PASSED_THROUGH = ("choices", "metavar", "nargs", "const")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, found {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, found {text!r}")
    return value


_PARSERS: dict[type, Callable[[str], Any]] = {int: _int, float: _float, str: str}


def _tuple_parser(kind: Any) -> Callable[[str], Any] | None:
    """``tuple[float, float]`` -> a parser of ``0.9,0.999``; None for anything else."""
    if typing.get_origin(kind) is not tuple:
        return None
    items = typing.get_args(kind)
    parsers = [_PARSERS.get(item) for item in items]
    if not items or Ellipsis in items or any(p is None for p in parsers):
        return None
    count = {2: "two", 3: "three"}.get(len(items), str(len(items)))
    example = {2: "0.9,0.999"}.get(len(items), ",".join("1" for _ in items))

    def parse(text: str) -> tuple[Any, ...]:
        parts = text.split(",")
        try:
            if len(parts) != len(parsers):
                raise argparse.ArgumentTypeError(text)
            return tuple(p(part) for p, part in zip(parsers, parts, strict=True))  # type: ignore[misc]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(
                f"expected {count} numbers separated by a comma, such as {example}; found {text!r}"
            ) from None

    return parse


def _parser_of(kind: Any) -> Callable[[str], Any] | None:
    if typing.get_origin(kind) is list:  # words after the flag (nargs in the metadata): each parsed as the item
        (item,) = typing.get_args(kind)
        return _PARSERS.get(item)
    return _PARSERS.get(kind) or _tuple_parser(kind)


def _fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


def _without_none(kind: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (kind, False)."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) < len(typing.get_args(kind)):
            return functools.reduce(operator.or_, args), True
    return kind, False


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    parsers: dict[str, Callable[[str], Any]] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (see the module docstring).

    ``parsers`` maps field names to argparse types for fields whose type has no parser of its own.
    """
    for f, hint in _fields(cls):
        meta = dict(f.metadata)
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{f.name} has no help text: every setting needs one to become a flag")
        default = f.default if f.default is not dataclasses.MISSING else None
        kind, optional = _without_none(hint)
        options: dict[str, Any] = {"dest": f.name, "default": default}
        options.update({key: meta[key] for key in _PASSED_THROUGH if key in meta})
        help_text = meta["help"]
        if kind is bool:
            # a switch that is on by default, or has no default, needs its --no- form too
            options["action"] = argparse.BooleanOptionalAction if optional or default else "store_true"
        else:
            parse = (parsers or {}).get(f.name) or _parser_of(kind)
            if parse is None:
                raise TypeError(f"{cls.__name__}.{f.name}: no parser for {hint}; pass one in parsers=")
            options["type"] = parse
            if default is not None and "default" not in help_text:
                help_text += f" (default {default})"
        options["help"] = help_text.replace("%", "%%")
        parser.add_argument(flag_of(f.name), **options)


def from_args(cls: Callable[..., T], args: argparse.Namespace) -> T:
    """An instance of the dataclass ``cls`` from the flags :func:`add_options` added."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
