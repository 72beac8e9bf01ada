"""``paratrain plan``: predicted step time, speed-up and efficiency of ddp at N devices. Flags from PlanConfig.

paratrain plan --max-world-size 8                          # measured on this machine, in seconds
paratrain plan --model mlp --width 2048 --validate         # and the prediction error against bench, here
"""

from __future__ import annotations

import argparse

from .options import from_args
from .tools_common import add_settings_options, finish_report

__all__ = ["add_plan_parser"]


def add_plan_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ..tools.plan import PlanConfig

    parser = commands.add_parser(
        "plan",
        help="predict ddp's step time, samples/s and efficiency at 1..N devices before renting them",
        description="Measure on one device (forward, backward and optimizer at the per-device batch each N "
        "implies, when each gradient is ready) and the all-reduce with real processes here (or take the link "
        "between machines as given), then model our DDP's overlapped bucket all-reduces. Prints one row per "
        "world size, the assumptions, and the world size past which devices stop paying. --validate runs bench "
        "here and prints the prediction error (exit 1 when one exceeds --max-error).",
    )
    add_settings_options(parser, PlanConfig)
    parser.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from ..tools.plan import PlanConfig, plan

    config = from_args(PlanConfig, args)
    config.validate_settings()
    return finish_report(plan(config), config.report_out)
