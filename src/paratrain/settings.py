"""Settings defined once: a dataclass field with its default, its help and its check.

A settings class is a dataclass of :func:`setting` fields deriving from :class:`Settings`; a command's settings
compose several such groups by inheritance, so a field shared by two commands is the same field object, with one
default, one help text and one check. The command-line flags are generated from the fields (``batch_size`` is
``--batch-size``), so a flag cannot drift from its field either::

    @dataclass
    class StepSettings(Settings):
        batch_size: int = setting(64, "samples per optimizer step", check=at_least(1))
        accumulate: int = setting(1, "micro-batches per step", check=at_least(1))

        def check_group(self) -> None:               # rules between this group's fields
            if self.accumulate > self.batch_size:
                raise ConfigError("--accumulate must be from 1 to --batch-size ...")

    StepSettings(batch_size=0).check()               # ConfigError: --batch-size must be at least 1; found 0

A field's check returns None for a good value, or what was expected (``"at least 1"``); :meth:`Settings.check`
turns that into one error naming the flag and the value found.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from paratrain.config_file import read_config, to_toml
from paratrain.errors import ConfigError

__all__ = [
    "Check",
    "Settings",
    "at_least",
    "below",
    "finite_positive",
    "flag_of",
    "one_of",
    "optional",
    "positive",
    "setting",
]

S = TypeVar("S", bound="Settings")
Check = Callable[[Any], "str | None"]  # None: the value is fine; otherwise what was expected, e.g. "at least 1"


def setting(default: Any, help: str, *, check: Check | None = None, **cli: Any) -> Any:
    """A settings field: its default, its help text, its check, and any argparse details (choices, metavar, nargs,
    const) as metadata."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, **cli})


def flag_of(name: str) -> str:
    """The flag of a field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


class Settings:
    """Base of every settings group: :meth:`check` runs every field's check, then every group's rules."""

    @classmethod
    def from_dict(cls: type[S], values: Mapping[str, Any], *, source: str = "settings") -> S:
        """An instance from plain values (JSON, TOML): lists become tuples where the field is a tuple.

        Raises:
            ConfigError: a key that is no setting of ``cls`` (``source`` names where the values came from).
        """
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(values) - names)
        if unknown:
            raise ConfigError(
                f"{source}: unknown setting(s) {', '.join(map(repr, unknown))}; {cls.__name__} takes "
                f"{', '.join(sorted(names))}"
            )
        hints = typing.get_type_hints(cls)
        converted = {
            key: tuple(value) if isinstance(value, list) and _is_tuple(hints[key]) else value
            for key, value in values.items()
        }
        return cls(**converted)

    @classmethod
    def from_file(cls: type[S], path: str | Path) -> S:
        """An instance from a TOML settings file (keys are flag names: ``batch-size = 128``), as ``--config`` reads
        it; settings the file leaves out keep their defaults.

        Raises:
            ConfigError: naming the file and the key: unreadable or invalid TOML, an unknown key, a wrong type, a
                value the setting's check refuses.
        """
        return cls(**read_config(path, [cls]))

    def to_toml(self, *, header: str = "") -> str:
        """Every setting as a TOML settings file (what :meth:`from_file` and ``--config`` read back)."""
        return to_toml(self.to_dict(), header=header)

    def to_dict(self) -> dict[str, Any]:
        """Every setting as a plain value (what :meth:`from_dict` takes back)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload, no-any-return]

    def check(self) -> None:
        """Raise ConfigError for the first setting no run can use, naming its flag; before any work starts."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            field_check = f.metadata.get("check")
            if field_check is None:
                continue
            value = getattr(self, f.name)
            expected = field_check(value)
            if expected is not None:
                raise ConfigError(_message(f.name, value, expected))
        # each group's own rules, base groups first; a group defines check_group in its own body
        for cls in reversed(type(self).__mro__):
            rules = cls.__dict__.get("check_group")
            if rules is not None:
                rules(self)


def _is_tuple(hint: Any) -> bool:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_tuple(arg) for arg in typing.get_args(hint))
    return hint is tuple or typing.get_origin(hint) is tuple


def _message(name: str, value: Any, expected: str) -> str:
    if expected.startswith("one of: "):
        return f"unknown {name.replace('_', ' ')} {value!r}; choose {expected}"
    return f"{flag_of(name)} must be {expected}; found {value!r}"


# -- checks: each returns None for a good value, or what was expected -----------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def at_least(low: float) -> Check:
    """A number >= ``low``."""

    def check(value: Any) -> str | None:
        if _is_number(value) and value >= low:
            return None
        return f"at least {low:g}" if low != 0 else "0 or more"

    return check


def positive(what: str = "") -> Check:
    """A number > 0 (``what`` names the unit: ``"seconds"``)."""
    expected = f"positive {what}".strip() if what else "positive"

    def check(value: Any) -> str | None:
        return None if _is_number(value) and value > 0 else expected

    return check


def finite_positive(value: Any) -> str | None:
    """A finite number > 0."""
    return None if _is_number(value) and 0 < value < math.inf else "a positive, finite number"


def below(high: float, low: float = 0.0) -> Check:
    """A number in (``low``, ``high``)."""

    def check(value: Any) -> str | None:
        return None if _is_number(value) and low < value < high else f"positive and below {high:.1e}"

    return check


def one_of(choices: Iterable[str]) -> Check:
    """One of ``choices``."""
    allowed = tuple(choices)

    def check(value: Any) -> str | None:
        return None if value in allowed else f"one of: {', '.join(allowed)}"

    return check


def optional(inner: Check) -> Check:
    """None, or a value ``inner`` accepts."""

    def check(value: Any) -> str | None:
        return None if value is None else inner(value)

    return check
