"""``paratrain launch``, and the launcher options it shares with ``paratrain train``.

paratrain launch --nproc-per-node 2 train.py --epochs 3
paratrain train --strategy ddp --nproc-per-node 2

The options are generated from :class:`~paratrain.launch.launcher.LaunchConfig`'s fields.
"""

from __future__ import annotations

import argparse
import signal
import sys

from paratrain.cli.argtypes import positive_int_or_auto
from paratrain.cli.help import ExamplesFormatter
from paratrain.cli.options import add_options, from_args
from paratrain.launch.launcher import LaunchConfig, launch

__all__ = ["add_launch_parser", "add_launcher_options", "launch_config", "report_exit"]


def add_launcher_options(parser: argparse.ArgumentParser) -> None:
    """The options that say how many processes on how many machines, shared by ``launch`` and ``train``."""
    group = parser.add_argument_group("processes and machines (torchrun)")
    add_options(group, LaunchConfig, parsers={"nproc_per_node": positive_int_or_auto, "nnodes": str})


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The :class:`LaunchConfig` the launcher options in ``args`` describe."""
    return from_args(LaunchConfig, args)


def add_launch_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``launch`` subcommand; its handler runs :func:`paratrain.launch.launcher.launch`."""
    lp = commands.add_parser(
        "launch",
        help="start a script on several processes or machines through torchrun",
        description="Start SCRIPT on every process of every node through torch.distributed.run (torchrun). "
        "Workers see RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. "
        "Everything after SCRIPT goes to the script unchanged.",
        epilog="examples:\n"
        "  paratrain launch --nproc-per-node 4 train.py --epochs 3\n"
        "  # on each of two machines:\n"
        "  paratrain launch --nnodes 2 --nproc-per-node 2 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job42 train.py",
        formatter_class=ExamplesFormatter,
    )
    add_launcher_options(lp)
    lp.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT")
    lp.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, module) every process runs")
    lp.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for the script")
    lp.set_defaults(
        handler=_launch_command,
        # argparse stops at the script, so a script's option given before it is unknown to launch
        unknown_hint="; options for the script go after it: paratrain launch [launch options] SCRIPT [script "
        "options], e.g. paratrain launch --nproc-per-node 2 train.py --epochs 1",
    )


# the signals the launcher forwards to the job (Ctrl-C ends in KeyboardInterrupt instead)
_STOPPING = {128 + getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, n)}


def report_exit(code: int, command: str) -> int:
    """Say that a signal stopped the job; a failed job's lines (one per failed rank) were printed by the launcher
    already, and its code is the first failed rank's."""
    if code in _STOPPING:
        print(f"paratrain {command}: stopped by {signal.Signals(code - 128).name}", file=sys.stderr)
    return code


def _launch_command(args: argparse.Namespace) -> int:
    code = launch(launch_config(args), args.script, args.script_args, module=args.module)
    return report_exit(code, "launch")
