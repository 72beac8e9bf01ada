"""What a run's checkpoint holds, and resuming from one: the position, the state, the settings that must match.

    position, run = restore(path, config, par, model, optimizer, scheduler)   # path: resume.plan_start's
    ...
    save(par, directory, config, model, optimizer, position, run, extra)

A position counts global batches, so a checkpoint resumes under any strategy and number of devices; under zero1
and zero2 a checkpoint is a directory of every process's slices (paratrain.checkpoint.sharded), read back the same,
each process reading only the slices of its shard. Beside the
state, a checkpoint records its run (:class:`RunRecord`): the epochs asked for, where the metrics went and every
epoch's train loss and test accuracy so far, which a resumed run extends and a complete run reports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from paratrain.checkpoint.file import checkpoint_name, prune_checkpoints
from paratrain.checkpoint.rng import rng_state, set_rng_state
from paratrain.checkpoint.sharded import read_plain
from paratrain.checkpoint.state_dicts import check_compatible
from paratrain.errors import CheckpointError, ConfigError
from paratrain.parallel import Parallel
from paratrain.training.config import TrainConfig
from paratrain.training.optimizers import restore_scheduler
from paratrain.training.resume import differences, identity

__all__ = ["Position", "RunRecord", "restore", "save"]


@dataclass
class Position:
    """Where the run is: the next batch to train, and the epoch's running loss."""

    epoch: int = 0
    batch: int = 0
    global_step: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0


@dataclass
class RunRecord:
    """What a checkpoint records about its run besides the state: the epochs asked for, where the metrics go,
    and each finished epoch's train loss and test accuracy since the run began (resumes included)."""

    epochs: int
    metrics_out: str | None = None
    epoch_losses: list[float] = field(default_factory=list)
    epoch_test_accuracy: list[float] = field(default_factory=list)


def save(
    par: Parallel,
    directory: Path,
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pos: Position,
    run: RunRecord,
    extra: dict[str, Any],
) -> None:
    state = {
        "model": model,  # as the strategy holds them: whole, or (zero1, zero2) each process's slices
        "optimizer": optimizer,
        "epoch": pos.epoch,
        "batch": pos.batch,
        "global_step": pos.global_step,
        "loss_sum": pos.loss_sum,
        "loss_count": pos.loss_count,
        "rng": rng_state(),
        "config": identity(config),
        "run": asdict(run),
        **extra,
    }
    par.save(state, directory / checkpoint_name(pos.epoch, pos.batch))
    if par.is_main:
        prune_checkpoints(directory, config.keep_checkpoints)


def restore(
    path: Path,
    config: TrainConfig,
    par: Parallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR | None,
) -> tuple[Position, RunRecord]:
    """Load the checkpoint at ``path`` (written under any strategy and world size) into the prepared ``model`` and
    ``optimizer``; its position, and its run's record so far. The optimizer reads only its process's shard.

    Raises:
        ConfigError: settings that cannot continue the checkpoint's run (each one named).
        CheckpointError: a checkpoint that is damaged, not paratrain train's, or does not fit the model.
    """
    try:
        state = par.load(path, into={"optimizer": optimizer})
    except (ValueError, KeyError) as exc:
        _check_continues(path, read_plain(path), config)  # another run's checkpoint explains it best
        raise CheckpointError(f"checkpoint {path}: the optimizer state does not fit this model: {exc}") from exc
    for key in ("model", "epoch", "batch", "global_step", "config", "rng"):
        if key not in state:
            raise CheckpointError(f"checkpoint {path} has no {key!r} entry; it was not written by paratrain train")
    _check_continues(path, state, config)
    check_compatible(par.unwrap(model).state_dict(), state["model"])
    par.unwrap(model).load_state_dict(state["model"])
    restore_scheduler(scheduler, state.get("scheduler"), f"checkpoint {path}")
    par.precision.load_state_dict(state.get("precision") or {})
    set_rng_state(state["rng"])
    position = Position(
        epoch=int(state["epoch"]),
        batch=int(state["batch"]),
        global_step=int(state["global_step"]),
        loss_sum=float(state.get("loss_sum", 0.0)),
        loss_count=int(state.get("loss_count", 0)),
    )
    saved = state.get("run") or {}
    run = RunRecord(
        epochs=config.epochs,
        metrics_out=config.metrics_out,
        epoch_losses=[float(x) for x in saved.get("epoch_losses", [])],
        epoch_test_accuracy=[float(x) for x in saved.get("epoch_test_accuracy", [])],
    )
    return position, run


def _check_continues(path: Path, state: dict[str, Any], config: TrainConfig) -> None:
    if "config" not in state:
        raise CheckpointError(f"checkpoint {path} has no 'config' entry; it was not written by paratrain train")
    differ = differences(state["config"], config)
    if differ:
        raise ConfigError(
            f"checkpoint {path} belongs to a run these settings cannot continue: {'; '.join(differ)}. Resume with "
            f"the checkpoint's settings, or start a new run in another --checkpoint-dir"
        )
