"""``paratrain env``: what a user pastes into a bug report: versions, accelerators, distributed backends."""

from __future__ import annotations

import argparse
import json

__all__ = ["add_env_parser"]


def add_env_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    env = commands.add_parser("env", help="versions, GPUs and distributed backends, for bug reports")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(handler=_env)


def _env(args: argparse.Namespace) -> int:
    from paratrain.tools.env import collect

    report = collect()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0
