"""``paratrain train`` as a whole: train in this process, or become the launcher of the ddp ranks that train.

    code = train_command(TrainConfig(epochs=1), LaunchConfig())                       # single, dp: here
    code = train_command(TrainConfig(strategy="ddp"), LaunchConfig(nproc_per_node=2))  # two ranks, launched
    code = train_command(TrainConfig(strategy="zero2"), LaunchConfig(nproc_per_node=4))  # sharded, four ranks

Every decision of the command lives here, not in the command line: which strategy ``auto`` is, whether this
process starts workers or is one, which devices ddp takes, what must hold before workers start (outputs, the
restart rule), and how a finished worker leaves. The workers run :mod:`paratrain.training.worker` on the same
settings, written to a job file.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import fields
from pathlib import Path

from ..environment import ClusterEnvironment
from ..errors import ConfigError
from ..launch import LaunchConfig, launch
from ..settings import flag_of
from ..strategies import PROCESS_STRATEGIES, check_ddp_devices, resolve_strategy
from .config import TrainConfig
from .job import train

__all__ = ["launch_train", "train_command"]


def train_command(config: TrainConfig, launcher: LaunchConfig | None = None) -> int:
    """Run ``paratrain train``: here (single, dp, or as a launched rank) or through launched ranks (ddp).

    Returns the exit code: 0, or the workers' code when ddp ranks were launched.

    Raises:
        ConfigError: settings no run can use, or launcher settings for a run that starts no processes; before
            any work starts.
    """
    launcher = launcher if launcher is not None else LaunchConfig()
    config.check()  # here, before any worker process starts
    environment = ClusterEnvironment.detect()
    strategy = resolve_strategy(config.strategy, config.devices, environment)
    if strategy not in PROCESS_STRATEGIES:
        given = _launcher_settings_given(launcher)
        if given:
            raise ConfigError(
                f"{', '.join(given)} start processes for strategy ddp, but strategy {config.strategy!r} resolves to "
                f"{strategy!r}, which runs in this one process; add --strategy ddp, or drop {', '.join(given)}"
            )
    if strategy in PROCESS_STRATEGIES and not environment.launched:
        return launch_train(config, launcher)
    train(config)
    return 0


def launch_train(config: TrainConfig, launcher: LaunchConfig) -> int:
    """Start the ranks of a ddp run (this process becomes their launcher) and return their exit code.

    Raises:
        ConfigError: launcher settings that cannot work, devices ddp does not take, outputs this machine cannot
            write, or restarts without checkpoints to restart from.
    """
    launcher.check()
    check_ddp_devices(config.devices, "--devices", resolve_strategy(config.strategy, config.devices))
    if launcher.is_single_node:
        config.check_outputs()  # rank 0 runs on this machine: its outputs are checked before it starts
    if launcher.max_restarts and config.checkpoint_dir is None:
        raise ConfigError(
            f"--max-restarts {launcher.max_restarts} restarts the workers after a failure, and they continue "
            f"from the latest checkpoint: add --checkpoint-dir DIR (and --checkpoint-every N for checkpoints "
            f"within an epoch), or every restart would train again from step 0"
        )
    with tempfile.TemporaryDirectory(prefix="paratrain-train-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"config": config.to_dict()}))
        return launch(launcher, "paratrain.training.worker", [str(job)], module=True)


def _launcher_settings_given(launcher: LaunchConfig) -> list[str]:
    defaults = LaunchConfig()
    return [flag_of(f.name) for f in fields(defaults) if getattr(launcher, f.name) != getattr(defaults, f.name)]
