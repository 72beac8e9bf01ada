"""argparse types for the few flags whose type is not a plain int, float, str or bool.

parser.add_argument("--nproc-per-node", type=positive_int_or_auto)      # "expected a positive integer or 'auto'"
"""

from __future__ import annotations

import argparse

__all__ = ["positive_int_or_auto"]


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
