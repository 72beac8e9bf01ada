"""``paratrain train`` as a whole: train in this process, or become the launcher of the ddp ranks that train.

    code = train_command(TrainConfig(epochs=1), LaunchConfig())                       # single, dp: here
    code = train_command(TrainConfig(strategy="ddp"), LaunchConfig(nproc_per_node=2))  # two ranks, launched
    code = train_command(TrainConfig(strategy="zero2"), LaunchConfig(nproc_per_node=4))  # sharded, four ranks

Every decision of the command lives here, not in the command line: which strategy ``auto`` is, whether this
process starts workers or is one, which devices ddp takes, what must hold before any work starts (settings
that apply to the strategy, the checkpoint directory, outputs, the restart rule, and for ddp the model against
the data), what a complete run says instead of training, and how a finished worker leaves. The workers run
:mod:`paratrain.training.worker` on the same settings, written to a job file.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from paratrain.environment import ClusterEnvironment
from paratrain.errors import ConfigError, TrainingInterrupted
from paratrain.launch.launcher import LaunchConfig, launch
from paratrain.settings import flag_of
from paratrain.strategies import (
    PROCESS_STRATEGIES,
    check_ddp_devices,
    honouring,
    refusal_of,
    resolve_devices,
    resolve_strategy,
)
from paratrain.training.config import TrainConfig
from paratrain.training.job import train
from paratrain.training.preflight import preflight
from paratrain.training.resume import plan_start

__all__ = ["launch_train", "train_command"]


def train_command(config: TrainConfig, launcher: LaunchConfig | None = None) -> int:
    """Run ``paratrain train``: here (single, dp, or as a launched rank) or through launched ranks (ddp).

    Returns the exit code: 0 (also when the run was complete already: it says so, and where its results are),
    or the workers' code when ddp ranks were launched.

    Raises:
        ConfigError: settings no run can use, settings for a strategy the run does not resolve to, or a checkpoint
            directory another run's checkpoints are in; before any work starts.
        TrainingInterrupted: Ctrl-C stopped the run; it said where, and what ``--resume`` continues from.
    """
    launcher = launcher if launcher is not None else LaunchConfig()
    config.check()  # here, before any worker process starts
    environment = ClusterEnvironment.detect()
    strategy = resolve_strategy(config.strategy, config.devices, environment)
    if strategy not in PROCESS_STRATEGIES:
        _refuse_ddp_settings(config, launcher, strategy)
    else:
        _refuse_ddp_options(config, strategy)  # what the strategy would refuse, before any rank starts
    if strategy == "dp":
        _note_one_replica(config)
    if strategy in PROCESS_STRATEGIES and not environment.launched:
        return launch_train(config, launcher)
    # a restarted process continues its run (the run decides from its own records); a first start is checked now
    if not environment.launched and not environment.restart_count:
        config.check_outputs()  # the paths first: the checkpoint directory is read next
        if _complete(config):
            return 0
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
    # on one machine the checkpoint directory is this machine's, and the job's first start is now; with several
    # machines another node may have started the job (and written checkpoints) already: the ranks decide
    if launcher.is_single_node and _complete(config):
        return 0
    preflight(config)  # what every rank would otherwise find and report on its own
    with tempfile.TemporaryDirectory(prefix="paratrain-train-") as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"config": config.to_dict(), "launch": launcher.to_dict()}))
        try:
            return launch(launcher, "paratrain.training.worker", [str(job)], module=True, name="paratrain train")
        except KeyboardInterrupt:
            # the ranks stopped together and rank 0 said where, and what --resume continues from
            raise TrainingInterrupted from None


def _complete(config: TrainConfig) -> bool:
    """True when the run to resume is complete already; it then says so and where its results are."""
    checkpoints = Path(config.checkpoint_dir) if config.checkpoint_dir is not None else None
    start = plan_start(config, checkpoints, continuing=False)
    if start.complete:
        print(start.complete_message(), flush=True)
    return start.complete


def _refuse_ddp_settings(config: TrainConfig, launcher: LaunchConfig, strategy: str) -> None:
    """Settings only a ddp run uses, given for a run in this one process: an error, not silently ignored."""
    defaults = LaunchConfig()
    given = [flag_of(f.name) for f in fields(defaults) if getattr(launcher, f.name) != getattr(defaults, f.name)]
    if given:
        raise ConfigError(
            f"{', '.join(given)} start processes for strategy ddp, but strategy {config.strategy!r} resolves to "
            f"{strategy!r}, which runs in this one process; add --strategy ddp, or drop {', '.join(given)}"
        )
    if config.timeout is not None:
        raise ConfigError(
            f"--timeout is for strategy 'ddp' (how long a collective waits for the other processes), but strategy "
            f"{config.strategy!r} resolves to {strategy!r} here, which runs in this one process and has no "
            f"collectives: drop --timeout, or add --strategy ddp"
        )
    options = config.ddp_options()
    flags = [flag_of(name) for name in options.given()]
    if flags:
        raise ConfigError(
            f"{', '.join(flags)} {'are' if len(flags) > 1 else 'is'} for strategies ddp, zero1 and zero2 (how "
            f"gradients cross processes), but strategy {config.strategy!r} resolves to {strategy!r} here, which "
            f"runs in this one process and would ignore {'them' if len(flags) > 1 else 'it'}: drop "
            f"{', '.join(flags)}, or add --strategy ddp"
        )


def _refuse_ddp_options(config: TrainConfig, strategy: str) -> None:
    """A DDP option (``--static-graph``, ...) the process strategy ``strategy`` cannot honour: an error, by flag."""
    for name in config.ddp_options().given():
        refusal = refusal_of(strategy, name)
        if refusal is not None:
            flag, others = flag_of(name), honouring(name)
            raise ConfigError(
                f"{flag} is not supported under strategy {strategy}: {refusal.why}; drop {flag}, or use --strategy "
                f"{', '.join(others[:-1])} or {others[-1]}"
            )


def _note_one_replica(config: TrainConfig) -> None:
    devices = resolve_devices(config.devices)
    if len(devices) == 1:
        print(
            f"paratrain train: note: --strategy dp on one device ({devices[0]}) runs a single replica: the same "
            f"training as --strategy single, with dp's overhead. To split each batch, give several devices "
            f"(--devices cpu,cpu for CPU replicas, --devices cuda:0,cuda:1 for two GPUs)",
            file=sys.stderr,
            flush=True,
        )
