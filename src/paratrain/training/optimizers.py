"""The optimizer and the learning-rate schedule of ``paratrain train``, built from the run's settings.

    optimizer = build_optimizer(model.parameters(), "adamw", lr=1e-3, weight_decay=None, betas=(0.9, 0.999))
    scheduler = build_scheduler(optimizer, "cosine", warmup_steps=100, total_steps=2000)   # None for constant
    ...
    optimizer.step(); scheduler.step()          # once per optimizer step

``cosine`` raises the learning rate linearly from 0 to ``lr`` over the warm-up steps, then follows half a cosine
down to 0 at ``total_steps``; ``constant`` keeps ``lr`` after the warm-up (and needs no scheduler without one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

from paratrain.errors import CheckpointError, ConfigError

__all__ = [
    "DEFAULT_BETAS",
    "LR_SCHEDULES",
    "OPTIMIZERS",
    "WarmupCosine",
    "apply_settings",
    "build_optimizer",
    "build_scheduler",
    "optimizer_settings",
    "restore_scheduler",
]

OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")
DEFAULT_BETAS = (0.9, 0.999)  # torch's AdamW defaults
_DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}  # torch's defaults for each


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float | None = None,
    betas: tuple[float, float] = DEFAULT_BETAS,
) -> torch.optim.Optimizer:
    """``sgd`` (with ``momentum``) or ``adamw`` (with ``betas``); ``weight_decay`` None takes torch's default."""
    decay = _DEFAULT_WEIGHT_DECAY.get(name, 0.0) if weight_decay is None else weight_decay
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(float(betas[0]), float(betas[1])), weight_decay=decay)
    raise ConfigError(f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}")


def apply_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: LambdaLR | None,
    name: str,
    *,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float | None = None,
    betas: tuple[float, float] = DEFAULT_BETAS,
) -> None:
    """Give a restored optimizer (and schedule) this run's settings: a resumed run may change them.

    Loading a checkpoint's optimizer state brings back the learning rate, momentum, weight decay and betas it
    was saved with; the settings given now take effect instead (the moments and the step count stay). With a
    schedule, ``lr`` becomes its peak, and the current learning rate follows from it at the current step.
    """
    decay = _DEFAULT_WEIGHT_DECAY.get(name, 0.0) if weight_decay is None else weight_decay
    for group in optimizer.param_groups:
        group["weight_decay"] = decay
        if "momentum" in group:
            group["momentum"] = momentum
        if "betas" in group:
            group["betas"] = (float(betas[0]), float(betas[1]))
        group["lr"] = lr
        if "initial_lr" in group:
            group["initial_lr"] = lr
    if scheduler is not None:
        scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
        for group in optimizer.param_groups:
            group["lr"] = lr * factor


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The settings the optimizer holds now (a resume restores the checkpoint's), JSON-able: what ran is what is told.

    ``lr`` is the peak (the schedule's base) when a schedule set ``initial_lr``.
    """
    group = optimizer.param_groups[0]
    settings: dict[str, Any] = {key: group[key] for key in ("momentum", "weight_decay", "betas") if key in group}
    settings["lr"] = group.get("initial_lr", group["lr"])
    return {key: list(v) if isinstance(v, tuple) else v for key, v in settings.items()}


class WarmupCosine:
    """The factor on the peak learning rate at each optimizer step: linear warm-up, then cosine (or flat) to the end.

    A plain object, not a closure, so it stays the same function after a resume.
    """

    def __init__(self, warmup_steps: int, total_steps: int, *, cosine: bool = True) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = max(total_steps, 1)
        self.cosine = cosine

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)  # never 0: the first step moves the weights
        if not self.cosine:
            return 1.0
        decay_steps = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / decay_steps, 1.0)
        return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, name: str, *, warmup_steps: int, total_steps: int
) -> LambdaLR | None:
    """The schedule stepped once per optimizer step; None when the learning rate never changes."""
    if name not in LR_SCHEDULES:
        raise ConfigError(f"unknown lr schedule {name!r}; choose one of: {', '.join(LR_SCHEDULES)}")
    if name == "constant" and warmup_steps == 0:
        return None
    return LambdaLR(optimizer, WarmupCosine(warmup_steps, total_steps, cosine=name == "cosine"))


def restore_scheduler(scheduler: LambdaLR | None, saved: dict[str, Any] | None, where: str) -> None:
    """Continue the saved schedule (``where``: the checkpoint, for errors).

    Raises:
        CheckpointError: the saved schedule differs from the one this run would compute, which would make the
            learning rate jump (``--warmup-steps``, or ``--epochs`` with cosine, changed), or only one has a schedule.
    """
    if scheduler is None and saved is None:
        return
    if scheduler is None or saved is None:
        has, run = ("a", "does not") if saved is not None else ("no", "does")
        raise CheckpointError(
            f"{where} has {has} learning rate schedule and this run {run}: resume with the same --lr-schedule and "
            f"--warmup-steps"
        )
    mine = dict(scheduler.lr_lambdas[0].__dict__)
    theirs = (saved.get("lr_lambdas") or [None])[0] or {}
    if theirs != mine:
        raise CheckpointError(
            f"{where} follows the schedule {theirs} but this run's is {mine} (--warmup-steps, or --epochs with "
            f"--lr-schedule cosine, changed); resume with the same settings"
        )
    scheduler.load_state_dict(saved)
