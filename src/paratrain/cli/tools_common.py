"""What ``paratrain verify``, ``bench`` and ``plan`` share on the command line: flags from a settings class,
and printing a report with its exit code (0 passed, 1 a finding that fails the check, 2 a usage error)."""

from __future__ import annotations

import argparse
from typing import Any

from .options import add_options

__all__ = ["add_settings_options", "finish_report"]


def add_settings_options(parser: argparse.ArgumentParser, settings: type) -> None:
    """One flag per field of ``settings`` (``--configs`` takes several words)."""
    add_options(parser, settings, parsers={"configs": str})


def finish_report(report: Any, report_out: str | None) -> int:
    print(report.render())
    if report_out:
        print(f"\nwrote {report_out}")
    return 0 if report.ok else 1
