"""The ``paratrain`` command: argument parsing only; every command calls the library.

paratrain train                           # the MNIST DataParallel tutorial's job (see `paratrain train --help`)
paratrain train --config run.toml --lr 0.1  # settings from a TOML file, the command line overriding it
paratrain launch --nproc-per-node 2 x.py  # any script, through torchrun
paratrain env                             # versions, GPUs, distributed backends
paratrain demo --devices cpu,cpu,cpu      # the DataParallel tutorial's demo: how each batch is split
paratrain verify                          # does every configuration train like one device?
paratrain bench                           # how much faster is each configuration?
paratrain plan --max-world-size 8         # how much faster will N devices be?
paratrain checkpoint consolidate DIR OUT.pt   # a (sharded) checkpoint as one plain torch file
paratrain checkpoint consolidate --format safetensors DIR OUT.safetensors
paratrain checkpoint export --format dcp DIR OUT   # as torch.distributed.checkpoint's directory
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from paratrain.cli.checkpoint import add_checkpoint_parser
from paratrain.cli.config import apply_config_file, printed_config
from paratrain.cli.demo import add_demo_parser
from paratrain.cli.env import add_env_parser
from paratrain.cli.launch import add_launch_parser
from paratrain.cli.tools import add_tool_parsers
from paratrain.cli.train import add_train_parser
from paratrain.errors import CollectiveError, ConfigError, ParatrainError, TrainingInterrupted
from paratrain.version import __version__

__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "build_parser", "main"]

EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


class _Parser(argparse.ArgumentParser):
    """argparse, with usage errors on one line (``paratrain train: error: ...``) instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="paratrain", description="Take a PyTorch training loop from one device to many.")
    parser.add_argument("--version", action="version", version=f"paratrain {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    add_train_parser(commands)
    add_launch_parser(commands)
    add_env_parser(commands)
    add_demo_parser(commands)
    add_tool_parsers(commands)
    add_checkpoint_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 runtime error, 2 usage error).

    A closed standard output (``paratrain train | head -2``) ends the command quietly with 141, the code of a
    Unix tool that SIGPIPE ended, instead of a ``BrokenPipeError`` traceback.
    """
    parser = build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(raw)
    if unknown:
        # a subcommand may say where such arguments belong (launch: after the script)
        prog = f"paratrain {args.command}"
        hint = getattr(args, "unknown_hint", f" (see {prog} --help)")
        parser.exit(EXIT_USAGE, f"{prog}: error: unrecognized arguments: {' '.join(unknown)}{hint}\n")
    try:
        args = apply_config_file(parser, raw, args)
        if getattr(args, "print_config", False):
            print(printed_config(args), end="")
            return 0
        code: int = args.handler(args)
        return code
    except BrokenPipeError:
        from paratrain.training.progress import stdout_closed

        return stdout_closed()
    except ConfigError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ParatrainError as exc:
        print(f"paratrain {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(exc, CollectiveError):
            # a collective that will never complete: the interpreter's teardown would wait for it (gloo waits
            # its own timeout), keeping the whole job alive; leave now, so the launcher stops the others
            from paratrain.diagnostics.stacks import drop_unused_dump

            drop_unused_dump()  # os._exit skips atexit, where the stack file would go
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_RUNTIME)
        return EXIT_RUNTIME
    except TrainingInterrupted:
        return EXIT_INTERRUPTED  # the run said where it stopped and what --resume continues from
    except KeyboardInterrupt:
        print(f"paratrain {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
