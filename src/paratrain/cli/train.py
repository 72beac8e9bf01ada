"""``paratrain train``: the training job's flags (generated from TrainConfig and LaunchConfig) and its start.

paratrain train                                   # the MNIST DataParallel tutorial's job, on one device
paratrain train --devices cpu,cpu,cpu             # DataParallel over three CPU replicas: the same result
paratrain train --strategy ddp --nproc-per-node 2 # two processes: this one becomes their launcher
"""

from __future__ import annotations

import argparse

from paratrain.cli.config import add_config_options
from paratrain.cli.launch import add_launcher_options, launch_config, report_exit
from paratrain.cli.options import add_options, from_args

__all__ = ["add_train_parser"]


def add_train_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from paratrain.launch.launcher import LaunchConfig
    from paratrain.training.config import TrainConfig

    tr = commands.add_parser(
        "train",
        help="train a model (default: the MNIST DataParallel tutorial's SimpleNet job) on one device or many",
        description="Train a model on one device, several devices in one process, or one process per device. "
        "The defaults are the classic MNIST DataParallel tutorial's job: SimpleNet, batch 64, SGD with learning "
        "rate 0.01, 5 epochs (on the offline digits data). --batch-size is the global batch under every strategy, "
        "per optimizer step: with --accumulate K each process's share of it is cut into K micro-batches.",
    )
    add_options(tr, TrainConfig)
    add_launcher_options(tr)
    add_config_options(tr, (TrainConfig, LaunchConfig), "train")
    tr.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from paratrain.training.command import train_command  # the training stack is only imported when needed
    from paratrain.training.config import TrainConfig

    return report_exit(train_command(from_args(TrainConfig, args), launch_config(args)), "train")
