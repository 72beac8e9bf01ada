"""What a run's checkpoint holds, and resuming from one: the position, the state, the settings that must match.

    path = find_resume(config, checkpoints, continuing)    # asked for, or after a restart the latest
    position = restore(path, config, par, model, optimizer, scheduler)   # into the prepared model and optimizer
    ...
    save(par, directory, config, model, optimizer, position, extra)

A position counts global batches, so a checkpoint resumes under any strategy and number of devices; under zero1
and zero2 a checkpoint is a directory of every process's slices (paratrain.shard_checkpoint), read back the same.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ..checkpoint import checkpoint_name, latest_checkpoint, prune_checkpoints
from ..errors import CheckpointError
from ..parallel import Parallel
from ..rng import rng_state, set_rng_state
from ..shard_checkpoint import is_sharded_checkpoint, read_plain
from ..state_dicts import check_compatible
from .config import RESUME_MODES, TrainConfig
from .optimizers import restore_scheduler

__all__ = ["Position", "find_resume", "restore", "save"]

# what must match between a checkpoint and the run that resumes from it
_IDENTITY = ("model", "dataset", "batch_size", "seed", "width", "depth", "optimizer", "lr_schedule", "precision")
# what checkpoints written before a setting existed ran with
_IDENTITY_BEFORE = {"optimizer": "sgd", "lr_schedule": "constant", "precision": "32"}


@dataclass
class Position:
    """Where the run is: the next batch to train, and the epoch's running loss."""

    epoch: int = 0
    batch: int = 0
    global_step: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0


def find_resume(config: TrainConfig, checkpoints: Path | None, continuing: bool) -> Path | None:
    """The checkpoint to start from: the one asked for, or after a restart the latest one written."""
    if continuing and checkpoints is not None:
        # the launcher restarted this worker after a failure: continue from the newest checkpoint, which may be
        # newer than the one the first attempt resumed from
        latest = latest_checkpoint(checkpoints)
        if latest is not None:
            return latest
    if config.resume is None:
        return None
    if config.resume not in RESUME_MODES:
        path = Path(config.resume)
        if not (path.is_file() or is_sharded_checkpoint(path)):
            raise CheckpointError(f"--resume {config.resume}: no such checkpoint file (or sharded checkpoint)")
        return path
    assert checkpoints is not None  # check() requires it
    latest = latest_checkpoint(checkpoints)
    if latest is None and config.resume == "latest":
        raise CheckpointError(
            f"--resume: no checkpoint in {checkpoints}; drop --resume to start from scratch, or use "
            f"--resume if-exists to start from scratch only when there is none"
        )
    return latest


def _identity(config: TrainConfig) -> dict[str, Any]:
    values = {**asdict(config), "dataset": config.dataset_name}
    return {key: values[key] for key in _IDENTITY}


def save(
    par: Parallel,
    directory: Path,
    config: TrainConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    pos: Position,
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
        "config": _identity(config),
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
) -> Position:
    """Continue from the checkpoint at ``path`` (written under any strategy and world size) into the prepared
    ``model`` and ``optimizer``; the optimizer reads only the slices of its process's shard."""
    try:
        state = par.load(path, into={"optimizer": optimizer})
    except (ValueError, KeyError) as exc:
        _check_identity(path, read_plain(path), config)  # a different run explains it best
        raise CheckpointError(f"checkpoint {path}: the optimizer state does not fit this model: {exc}") from exc
    for key in ("model", "epoch", "batch", "global_step", "config", "rng"):
        if key not in state:
            raise CheckpointError(f"checkpoint {path} has no {key!r} entry; it was not written by paratrain train")
    _check_identity(path, state, config)
    check_compatible(par.unwrap(model).state_dict(), state["model"])
    par.unwrap(model).load_state_dict(state["model"])
    restore_scheduler(scheduler, state.get("scheduler"), f"checkpoint {path}")
    par.precision.load_state_dict(state.get("precision") or {})
    set_rng_state(state["rng"])
    return Position(
        epoch=int(state["epoch"]),
        batch=int(state["batch"]),
        global_step=int(state["global_step"]),
        loss_sum=float(state.get("loss_sum", 0.0)),
        loss_count=int(state.get("loss_count", 0)),
    )


def _check_identity(path: Path, state: dict[str, Any], config: TrainConfig) -> None:
    if "config" not in state:
        raise CheckpointError(f"checkpoint {path} has no 'config' entry; it was not written by paratrain train")
    saved, wanted = state["config"], _identity(config)
    saved = {**_IDENTITY_BEFORE, **saved}
    different = {k: (saved.get(k), v) for k, v in wanted.items() if saved.get(k) != v}
    if different:
        listed = ", ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in different.items())
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run ({listed}); resume with the same settings or use "
            f"another --checkpoint-dir"
        )
