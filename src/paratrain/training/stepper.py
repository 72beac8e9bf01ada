"""One optimizer step of ``paratrain train``: a global batch's micro-batches, backward, clipping, the step.

    stepper = Stepper(par, model, optimizer, scheduler, accumulate=4, clip_grad_norm=1.0, timer=timer)
    for batch in loader:                  # this process's share of each global batch
        outcome = stepper(batch)          # forward/backward per micro-batch, then clip, step, schedule

Everything numeric goes through :class:`~paratrain.parallel.Parallel`: loss weights, autocast and the gradient
scaler, synchronising once per step, the global gradient norm. The learning rate schedule advances only on
steps that were applied (``16-mixed`` skips steps whose gradients overflow), so it counts real updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LRScheduler

from paratrain.parallel import Parallel
from paratrain.training.timing import StepTimer

__all__ = ["LossMeter", "StepOutcome", "Stepper"]


@dataclass
class StepOutcome:
    """What one optimizer step did, in this process (tensors stay on the device until someone reads them)."""

    loss: torch.Tensor  # this process's mean loss over the step (the tutorial's printed value), detached
    samples: int  # this process's samples of the step
    lr: float  # the learning rate the step used
    applied: bool  # False when the precision skipped the step (inf/nan gradients)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping, when clipping or measured

    @property
    def loss_sum(self) -> torch.Tensor:
        """The loss summed over this process's samples of the step (float64; 0 for an empty share)."""
        if not self.samples:
            return torch.zeros((), dtype=torch.float64, device=self.loss.device)
        return self.loss.double() * self.samples


class LossMeter:
    """A running sum of the loss over this process's samples, costing one tensor operation per ``fold`` steps.

    Every step's loss is kept as it is (a detached 0-dim tensor) and summed in one go when read, or when
    ``fold`` of them have gathered: the step itself does no arithmetic for the bookkeeping, and reading never
    synchronises a GPU more than once.
    """

    def __init__(self, device: torch.device, total: float = 0.0, count: int = 0, *, fold: int = 256) -> None:
        self._sum = torch.tensor(total, dtype=torch.float64, device=device)
        self._count = count
        self._fold_at = fold
        self._losses: list[torch.Tensor] = []
        self._weights: list[int] = []

    def add(self, loss: torch.Tensor, samples: int) -> None:
        if not samples:  # an empty share's mean loss is NaN (0/0), and NaN * 0 is still NaN
            return
        self._losses.append(loss)
        self._weights.append(samples)
        self._count += samples
        if len(self._losses) >= self._fold_at:
            self._fold()

    def _fold(self) -> None:
        if self._losses:
            weights = torch.tensor(self._weights, dtype=torch.float64, device=self._sum.device)
            self._sum += torch.stack(self._losses).double() @ weights
            self._losses, self._weights = [], []

    def totals(self) -> tuple[torch.Tensor, int]:
        """The loss summed over the samples so far (a float64 tensor on the device), and their number."""
        self._fold()
        return self._sum, self._count


class Stepper:
    """Runs optimizer steps over global batches for one model, optimizer and schedule."""

    def __init__(
        self,
        par: Parallel,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: LRScheduler | None,
        *,
        accumulate: int,
        clip_grad_norm: float | None,
        timer: StepTimer,
    ) -> None:
        self.par = par
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.accumulate = accumulate
        self.clip_grad_norm = clip_grad_norm
        self.timer = timer
        # zero_grad(set_to_none=True) of torch's own optimizers, without its per-call profiler range and grouping:
        # the gradients set to None directly (an optimizer class of its own keeps its zero_grad)
        own = type(optimizer).zero_grad is torch.optim.Optimizer.zero_grad
        self._params = [p for group in optimizer.param_groups for p in group["params"]] if own else None

    def __call__(self, batch: Any, *, measure_grad_norm: bool = False) -> StepOutcome:
        """One optimizer step on ``batch``; ``measure_grad_norm``: report the gradient's norm even without clipping
        (the job asks at logged steps only: the norm reads every gradient)."""
        par, timer = self.par, self.timer
        if self.accumulate == 1:
            images, labels = batch
            loss = F.cross_entropy(self.model(images), labels)
            timer.lap("forward")
            par.backward(loss)
            timer.lap("backward")
            samples = len(labels)
            loss = loss.detach()
        else:
            loss, samples = self._micro_batches(batch)
        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = par.clip_grad_norm_(self.model, self.clip_grad_norm)
        elif measure_grad_norm:  # an infinite bound clips nothing: the norm, with 16-mixed's unscaling, and no more
            grad_norm = par.clip_grad_norm_(self.model, math.inf)
        applied = par.step(self.optimizer)
        if applied and self.scheduler is not None:
            self.scheduler.step()
        self._zero_grad()
        timer.lap("optimizer")
        return StepOutcome(loss, samples, lr, applied, grad_norm)

    def _micro_batches(self, batch: Any) -> tuple[torch.Tensor, int]:
        """Forward and backward of each micro-batch; the step's mean loss over them, and its samples."""
        par, timer = self.par, self.timer
        loss_sum = torch.zeros((), dtype=torch.float64, device=par.device)
        samples = 0
        for images, labels in par.accumulate(self.model, batch, steps=self.accumulate):
            loss = F.cross_entropy(self.model(images), labels)
            timer.lap("forward")
            par.backward(loss)
            timer.lap("backward")
            if len(labels):  # an empty share's mean loss is NaN (0/0), and NaN * 0 is still NaN
                loss_sum += loss.detach().double() * len(labels)
                samples += len(labels)
        return loss_sum / max(samples, 1), samples

    def _zero_grad(self) -> None:
        if self._params is None:
            self.optimizer.zero_grad()
            return
        for p in self._params:
            p.grad = None
