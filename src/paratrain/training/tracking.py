"""The series ``paratrain train --log-dir`` records, gathered from every rank and written by rank 0.

    tracker = Tracker(par, run_log)          # run_log: a RunLog in the main process, None elsewhere
    tracker.add(outcome, global_samples)     # every step
    tracker.log_step(step=120, epoch=1, skipped_steps=0, step_seconds=timer.elapsed)  # every --log-every steps
    tracker.log_epoch(step=138, epoch=1, train_loss=0.31, test_accuracy=0.88)

``train/loss`` is the mean loss over every sample of every rank since the previous logged step (one small
all-reduce per logged step), so the curve is the global batch's, not one rank's. ``train/samples_per_s`` counts
global samples over the time the interval's steps took (the step timer's, so evaluation and checkpoints between
epochs do not count). ``train/lr`` is the rate the logged step used,
``train/skipped_steps`` the steps 16-mixed skipped so far, ``train/grad_norm`` the global gradient norm before
clipping (with ``--clip-grad-norm``); ``epoch/train_loss`` and ``epoch/test_accuracy`` come once per epoch.
"""

from __future__ import annotations

import torch

from ..parallel import Parallel
from .logs import RunLog
from .stepper import StepOutcome

__all__ = ["Tracker"]


class Tracker:
    """Interval sums of the steps since the last logged one, and the writes (only where ``run_log`` is given)."""

    def __init__(self, par: Parallel, run_log: RunLog | None) -> None:
        self.par = par
        self.run_log = run_log
        self._loss = torch.zeros(2, dtype=torch.float64, device=par.device)  # loss sum, samples (this rank)
        self._samples = 0  # global samples
        self._seconds = 0.0  # the step timer's total at the previous logged step
        self._latest: StepOutcome | None = None

    def add(self, outcome: StepOutcome, global_samples: int) -> None:
        self._loss[0] += outcome.loss_sum
        self._loss[1] += outcome.samples
        self._samples += global_samples
        self._latest = outcome

    def log_step(self, *, step: int, epoch: int, skipped_steps: int, step_seconds: float) -> None:
        """Write the interval's values at optimizer step ``step`` (a collective: call it in every process).

        ``step_seconds`` is the time every step so far took, in total.
        """
        loss_sum, samples = self.par.all_reduce(self._loss, "sum").tolist()
        elapsed = max(step_seconds - self._seconds, 1e-9)
        latest = self._latest
        if self.run_log is not None and latest is not None:
            values = {
                "train/loss": loss_sum / samples if samples else float("nan"),
                "train/lr": latest.lr,
                "train/samples_per_s": self._samples / elapsed,
                "train/skipped_steps": float(skipped_steps),
            }
            if latest.grad_norm is not None:
                values["train/grad_norm"] = float(latest.grad_norm)
            self.run_log.scalars(values, step=step, epoch=epoch)
        self._loss.zero_()
        self._samples = 0
        self._seconds = step_seconds

    def log_epoch(self, *, step: int, epoch: int, train_loss: float, test_accuracy: float) -> None:
        """Write the epoch's values and redraw the curves (main process only; no collective)."""
        if self.run_log is None:
            return
        self.run_log.scalars(
            {"epoch/train_loss": train_loss, "epoch/test_accuracy": test_accuracy}, step=step, epoch=epoch
        )
        self.run_log.plot()

    def close(self) -> None:
        if self.run_log is not None:
            self.run_log.plot()
            self.run_log.close()
