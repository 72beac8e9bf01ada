"""``paratrain train``: the training job's flags (generated from TrainConfig) and its start.

paratrain train                                   # the MNIST DataParallel tutorial's job, on one device
paratrain train --devices cpu,cpu,cpu             # DataParallel over three CPU replicas: the same result
paratrain train --strategy ddp --nproc-per-node 2 # two processes: this one becomes their launcher
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields

from ..errors import ConfigError
from ..launch import LaunchConfig, launch
from ..strategies import launched_by_torchrun, resolve_strategy
from ..strategies.ddp import DDP_DEVICES
from .launch import add_launcher_options, launch_config, report_exit
from .options import add_options, flag_of, from_args

__all__ = ["add_train_parser"]


def add_train_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from ..training.config import TrainConfig

    tr = commands.add_parser(
        "train",
        help="train a model (default: the MNIST DataParallel tutorial's SimpleNet job) on one device or many",
        description="Train a model on one device, several devices in one process, or one process per device. "
        "The defaults are the classic MNIST DataParallel tutorial's job: SimpleNet, batch 64, SGD with learning "
        "rate 0.01, 5 epochs (on the offline digits data). --batch-size is the global batch under every strategy, "
        "per optimizer step: with --accumulate K each process's share of it is cut into K micro-batches.",
    )
    add_options(tr, TrainConfig, parsers={"betas": _betas})
    add_launcher_options(tr)
    tr.set_defaults(handler=_train)


def _betas(text: str) -> tuple[float, float]:
    """``0.9,0.999`` -> (0.9, 0.999)."""
    parts = text.split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 2:
        raise argparse.ArgumentTypeError(
            f"expected two numbers separated by a comma, such as 0.9,0.999; found {text!r}"
        )
    return values[0], values[1]


def _train(args: argparse.Namespace) -> int:
    from ..training.config import TrainConfig
    from ..training.job import train  # the training stack is only imported when needed

    config = from_args(TrainConfig, args)
    config.validate()  # here, before any worker process starts
    launcher = launch_config(args)
    strategy = resolve_strategy(config.strategy, config.devices)
    if strategy != "ddp":
        given = _launcher_flags_given(launcher)
        if given:
            raise ConfigError(
                f"{', '.join(given)} start processes for strategy ddp, but strategy {config.strategy!r} resolves to "
                f"{strategy!r}, which runs in this one process; add --strategy ddp, or drop {', '.join(given)}"
            )
    elif not launched_by_torchrun():
        launcher.validate()
        if config.devices.strip() not in DDP_DEVICES:
            raise ConfigError(
                f"--strategy ddp runs one process per device and takes --devices {', '.join(DDP_DEVICES)} (each "
                f"process uses its local rank's GPU, or the CPU); found {config.devices!r}. For a list of devices "
                f"in one process use --strategy dp; for N processes, --nproc-per-node N"
            )
        if launcher.is_single_node:
            config.check_outputs()  # rank 0 runs on this machine: its outputs are checked before it starts
        if launcher.max_restarts and config.checkpoint_dir is None:
            raise ConfigError(
                f"--max-restarts {launcher.max_restarts} restarts the workers after a failure, and they continue "
                f"from the latest checkpoint: add --checkpoint-dir DIR (and --checkpoint-every N for checkpoints "
                f"within an epoch), or every restart would train again from step 0"
            )
        # this process becomes the launcher; every worker runs this same command under torchrun
        code = launch(launcher, "paratrain", ["train", *args.argv], module=True)
        return report_exit(code, "train")
    train(config)
    if launched_by_torchrun():
        # A worker whose job is done (results written, process group destroyed, our threads joined) leaves
        # without the interpreter's teardown. Native threads that outlive it (gloo's, the store's) may still drop
        # the last reference to a Python object then, which kills the process with SIGABRT ("terminate called
        # without an active exception") and turns a finished job into a failed one. The library avoids every such
        # object it knows of (collectives.no_python_in_work); this is the command's guard for the rest (seen once
        # in a full test suite run beside a stress run, with the machine at a load of 3 per core).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _launcher_flags_given(launcher: LaunchConfig) -> list[str]:
    defaults = LaunchConfig()
    return [flag_of(f.name) for f in fields(defaults) if getattr(launcher, f.name) != getattr(defaults, f.name)]
