"""One optimizer step of ``paratrain train``: a global batch's micro-batches, backward, clipping, the step.

    stepper = Stepper(par, model, optimizer, scheduler, accumulate=4, clip_grad_norm=1.0, timer=timer)
    for batch in loader:                  # this process's share of each global batch
        outcome = stepper(batch)          # forward/backward per micro-batch, then clip, step, schedule

Everything numeric goes through :class:`~paratrain.parallel.Parallel`: loss weights, autocast and the gradient
scaler, synchronising once per step, the global gradient norm. The learning rate schedule advances only on
steps that were applied (``16-mixed`` skips steps whose gradients overflow), so it counts real updates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import LRScheduler

from ..parallel import Parallel
from .timing import StepTimer

__all__ = ["StepOutcome", "Stepper"]


@dataclass
class StepOutcome:
    """What one optimizer step did, in this process (tensors stay on the device until someone reads them)."""

    loss_sum: torch.Tensor  # float64: the loss summed over this process's samples of the step
    samples: int  # this process's samples of the step
    loss: torch.Tensor  # this process's mean loss over the step (the tutorial's printed value)
    lr: float  # the learning rate the step used
    applied: bool  # False when the precision skipped the step (inf/nan gradients)
    grad_norm: torch.Tensor | None  # the global gradient norm before clipping, when clipping


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

    def __call__(self, batch: Any) -> StepOutcome:
        par, timer = self.par, self.timer
        loss_sum = torch.zeros((), dtype=torch.float64, device=par.device)
        samples = 0
        loss = loss_sum
        for images, labels in par.accumulate(self.model, batch, steps=self.accumulate):
            loss = F.cross_entropy(self.model(images), labels)
            timer.lap("forward")
            par.backward(loss)
            timer.lap("backward")
            if len(labels):  # an empty share's mean loss is NaN (0/0), and NaN * 0 is still NaN
                loss_sum += loss.detach().double() * len(labels)
                samples += len(labels)
        if self.accumulate > 1:  # the step's mean over its micro-batches; one micro-batch: its own loss
            loss = loss_sum / max(samples, 1)
        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = None
        if self.clip_grad_norm is not None:
            grad_norm = par.clip_grad_norm_(self.model, self.clip_grad_norm)
        applied = par.step(self.optimizer)
        if applied and self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        timer.lap("optimizer")
        return StepOutcome(loss_sum, samples, loss.detach(), lr, applied, grad_norm)
