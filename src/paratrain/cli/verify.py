"""``paratrain verify``: does every configuration train like one device? Flags from VerifyConfig.

paratrain verify                                           # every configuration this machine can run
paratrain verify --model mypkg.nets:make --input-shape 3,32,32 --configs single dp:cpu,cpu ddp:2
"""

from __future__ import annotations

import argparse

from .options import from_args
from .tools_common import add_settings_options, finish_report

__all__ = ["add_verify_parser"]


def add_verify_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ..tools.verify import VerifyConfig

    parser = commands.add_parser(
        "verify",
        help="check that every parallel configuration gives one device's losses, gradients and parameters",
        description="Run each configuration for a few optimizer steps from the same weights on the same global "
        "batches and compare the loss, every synchronised gradient and every parameter with single. Names the "
        "first parameter that diverges (in forward order) and the likely cause. Exit 0 when all pass, 1 when one "
        "differs or fails to run, 2 on a usage error. Configurations this machine cannot run are SKIPPED.",
    )
    add_settings_options(parser, VerifyConfig)
    parser.set_defaults(handler=_verify)


def _verify(args: argparse.Namespace) -> int:
    from ..tools.verify import VerifyConfig, verify

    config = from_args(VerifyConfig, args)
    config.validate_settings()
    return finish_report(verify(config), config.report_out)
