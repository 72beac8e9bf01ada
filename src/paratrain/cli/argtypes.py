"""argparse types for numbers with bounds, so every command reports bad numbers the same way.

parser.add_argument("--epochs", type=positive_int)      # "expected a positive integer, found 0"
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["non_negative_int", "positive_float", "positive_int", "positive_int_or_auto"]


def _bounded(cast: Callable[[str], float], ok: Callable[[float], bool], expected: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, found {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, found {value}")
        return value

    return parse


positive_int: Callable[[str], int] = _bounded(int, lambda v: v >= 1, "a positive integer")  # type: ignore[assignment]
non_negative_int: Callable[[str], int] = _bounded(int, lambda v: v >= 0, "an integer >= 0")  # type: ignore[assignment]
positive_float: Callable[[str], float] = _bounded(float, lambda v: v > 0, "a positive number")


def positive_int_or_auto(text: str) -> int | str:
    """``auto``, or a positive integer."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', found {value}")
    return value
