"""The command-line side of the launcher: ``paratrain launch`` and the launcher options of ``paratrain train``.

paratrain launch --nproc-per-node 2 train.py --epochs 3
paratrain train --strategy ddp --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import signal
import sys

from .argtypes import positive_int_or_auto
from .launch import LaunchConfig, launch

__all__ = ["add_launch_parser", "add_launcher_options", "launch_config"]


def add_launcher_options(parser: argparse.ArgumentParser) -> None:
    """The options that say how many processes on how many machines, shared by ``launch`` and ``train``."""
    defaults = LaunchConfig()
    group = parser.add_argument_group("processes and machines (torchrun)")
    group.add_argument(
        "--nproc-per-node",
        type=positive_int_or_auto,
        default=defaults.nproc_per_node,
        metavar="N|auto",
        help="processes on this machine (default auto: one per GPU, one without a GPU)",
    )
    group.add_argument("--nnodes", default=defaults.nnodes, metavar="N|MIN:MAX", help="number of machines (default 1)")
    group.add_argument(
        "--node-rank", type=int, default=defaults.node_rank, metavar="R", help="this machine's rank, static rendezvous"
    )
    group.add_argument("--master-addr", metavar="ADDR", help="address of node 0 (static rendezvous)")
    group.add_argument("--master-port", type=int, metavar="PORT", help="port on node 0 (static rendezvous)")
    group.add_argument(
        "--rdzv-endpoint", metavar="HOST:PORT", help="c10d rendezvous; the same on every machine; it numbers the nodes"
    )
    group.add_argument("--rdzv-id", metavar="ID", help="a job id shared by the nodes of one job")
    group.add_argument(
        "--rdzv-timeout", type=int, metavar="SECONDS", help="how long a node waits for the others (default 600)"
    )
    group.add_argument("--local-addr", metavar="ADDR", help="the address other machines reach this one at")
    group.add_argument(
        "--max-restarts",
        type=int,
        default=defaults.max_restarts,
        metavar="K",
        help="restart the workers up to K times after a failure (default 0)",
    )
    group.add_argument(
        "--monitor-interval",
        type=float,
        default=defaults.monitor_interval,
        metavar="SECONDS",
        help=f"how often torchrun checks its workers (default {defaults.monitor_interval:g})",
    )


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """The :class:`LaunchConfig` the launcher options in ``args`` describe."""
    return LaunchConfig(
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_timeout=args.rdzv_timeout,
        local_addr=args.local_addr,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
    )


def add_launch_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add the ``launch`` subcommand; its handler runs :func:`paratrain.launch.launch`."""
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
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_launcher_options(lp)
    lp.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, run as python -m SCRIPT")
    lp.add_argument("script", metavar="SCRIPT", help="the script (or, with -m, module) every process runs")
    lp.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="arguments for the script")
    lp.set_defaults(handler=_launch_command)


def report_exit(code: int, command: str) -> int:
    """Say why a launched job ended badly (torchrun's own summary above names the failed ranks)."""
    if code > 128 and code - 128 in signal.valid_signals():
        print(f"paratrain {command}: stopped by {signal.Signals(code - 128).name}", file=sys.stderr)
    elif code != 0:
        print(
            f"paratrain {command}: error: torchrun exited with code {code}; its summary above names the failed rank(s)",
            file=sys.stderr,
        )
    return code


def _launch_command(args: argparse.Namespace) -> int:
    code = launch(launch_config(args), args.script, args.script_args, module=args.module)
    return report_exit(code, "launch")
