"""The series ``paratrain train --log-dir`` records, gathered from every rank and written by rank 0.

    tracker = Tracker(par, run_log)          # run_log: a RunLog in the main process, None elsewhere
    tracker.add(outcome)                     # every step
    tracker.log_step(step=120, epoch=1, skipped_steps=0, values=logged.values())  # every --log-every steps
    tracker.log_epoch(step=138, epoch=1, train_loss=0.31, test_accuracy=0.88)

``train/loss`` is the mean loss over every sample of every rank since the previous logged step (one small
all-reduce per logged step), so the curve is the global batch's, not one rank's. The log line's values
(:mod:`paratrain.training.log_line`: ``train/lr``, ``train/grad_norm``, ``train/samples_per_s``,
``train/step_seconds``, ``memory/...``, ``train/flops_per_s``, ``train/mfu``) are written as printed;
``train/skipped_steps`` counts the steps 16-mixed skipped so far; ``epoch/train_loss`` and ``epoch/test_accuracy``
come once per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from paratrain.parallel import Parallel
from paratrain.training.logs import RunLog
from paratrain.training.stepper import StepOutcome
from paratrain.training.trackers import ExperimentTracker

__all__ = ["Tracker"]


class Tracker:
    """Interval sums of the steps since the last logged one, and the writes (only where ``run_log`` is given)."""

    def __init__(self, par: Parallel, run_log: RunLog | None, trackers: Sequence[ExperimentTracker] = ()) -> None:
        self.par = par
        self.run_log = run_log
        self.trackers = list(trackers)  # --log-with's, in the main process: the same rows as run_log
        self._loss = torch.zeros(2, dtype=torch.float64, device=par.device)  # loss sum, samples (this rank)
        self._latest: StepOutcome | None = None

    def add(self, outcome: StepOutcome) -> None:
        self._loss[0] += outcome.loss_sum
        self._loss[1] += outcome.samples
        self._latest = outcome

    def log_step(self, *, step: int, epoch: int, skipped_steps: int, values: Mapping[str, float]) -> None:
        """Write the interval's values at optimizer step ``step`` (a collective: call it in every process).

        ``values`` are the log line's (:class:`~paratrain.training.log_line.LoggedStep`), written as they are.
        """
        loss_sum, samples = self.par.all_reduce(self._loss, "sum").tolist()
        if self.run_log is not None and self._latest is not None:
            loss = loss_sum / samples if samples else float("nan")
            row = {"train/loss": loss, **values, "train/skipped_steps": float(skipped_steps)}
            self.run_log.scalars(row, step=step, epoch=epoch)
            for tracker in self.trackers:
                tracker.scalars(row, step=step)
        self._loss.zero_()

    def log_epoch(self, *, step: int, epoch: int, train_loss: float, test_accuracy: float) -> None:
        """Write the epoch's values and redraw the curves (main process only; no collective)."""
        if self.run_log is None:
            return
        row = {"epoch/train_loss": train_loss, "epoch/test_accuracy": test_accuracy}
        self.run_log.scalars(row, step=step, epoch=epoch)
        for tracker in self.trackers:
            tracker.scalars(row, step=step)
        self.run_log.plot()

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
        if self.run_log is not None:
            self.run_log.plot()
            self.run_log.close()
