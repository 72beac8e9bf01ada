"""``paratrain demo``: the DataParallel tutorial's demo, showing how DataParallel splits each batch.

paratrain demo                          # every GPU, or two CPU replicas without one
paratrain demo --devices cpu,cpu,cpu    # 30 samples -> 10 per replica
"""

from __future__ import annotations

import argparse

from paratrain.cli.options import add_options, from_args

__all__ = ["add_demo_parser"]


def add_demo_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from paratrain.training.demo import DemoConfig

    parser = commands.add_parser(
        "demo",
        help="the DataParallel tutorial's demo: how each batch is split",
        description="The DataParallel tutorial's demo: a Linear(5, 2) model that prints the size of what each "
        "replica receives, on batches of 30 random vectors: 30 samples on 2 devices are 15 each, on 3 devices 10.",
    )
    add_options(parser, DemoConfig)
    parser.set_defaults(handler=_demo)


def _demo(args: argparse.Namespace) -> int:
    from paratrain.training.demo import DemoConfig, demo

    demo(from_args(DemoConfig, args))
    return 0
