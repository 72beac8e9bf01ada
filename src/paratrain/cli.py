"""The ``paratrain`` command: argument parsing only; every command calls the library.

paratrain env                             # versions, GPUs, distributed backends
paratrain demo --devices cpu,cpu,cpu      # the first seed's DataParallel demo
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from . import demo, env_info
from .devices import parse_devices_arg
from .errors import ConfigError, ParatrainError
from .version import __version__

__all__ = ["build_parser", "main"]

EXIT_RUNTIME = 1
EXIT_USAGE = 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, found {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain", description="Take a PyTorch training loop from one device to many."
    )
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    env = commands.add_parser("env", help="versions, GPUs and distributed backends, for bug reports")
    env.add_argument("--json", action="store_true", help="print the report as JSON")
    env.set_defaults(handler=_env)

    dm = commands.add_parser("demo", help="the first seed's DataParallel demo: how each batch is split")
    dm.add_argument("--devices", default="auto", help="auto (every GPU, or cpu,cpu without one), cpu,cpu,cpu, 0,1, ...")
    dm.add_argument("--batch-size", type=_positive_int, default=30)
    dm.add_argument("--data-size", type=_positive_int, default=100)
    dm.add_argument("--seed", type=int, default=0)
    dm.set_defaults(handler=_demo)
    return parser


def _env(args: argparse.Namespace) -> int:
    report = env_info.collect()
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.render())
    return 0


def _demo(args: argparse.Namespace) -> int:
    devices = parse_devices_arg(args.devices) or demo.default_demo_devices()
    demo.run_demo(devices, batch_size=args.batch_size, data_size=args.data_size, seed=args.seed)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 runtime error, 2 usage error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
        return code
    except ConfigError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ParatrainError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted", file=sys.stderr)
        return 130
