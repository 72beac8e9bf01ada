"""Progress for the main process: a tqdm bar per epoch, the tutorial's loss line, epoch summaries.

The bar goes to stderr and only when it is a terminal; log lines go to stdout through ``tqdm.write`` so they
do not tear the bar. Reading a loss value synchronises a GPU, so the bar reads it only every few steps.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

__all__ = ["Progress"]

POSTFIX_EVERY = 10


class Progress:
    """Reports a run's progress; everything is a no-op outside the main process."""

    def __init__(self, *, enabled: bool, bar: bool | None = None, log: Callable[[str], None] | None = None) -> None:
        self.enabled = enabled
        self.bar_enabled = enabled and (sys.stderr.isatty() if bar is None else bar)
        self._log = log
        self._bar: tqdm | None = None
        self._start = 0.0
        self._samples = 0

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._log is not None:
            self._log(line)
        elif self._bar is not None:
            tqdm.write(line)
        else:
            print(line, flush=True)

    def start_epoch(self, epoch: int, epochs: int, batches: int, done: int = 0) -> None:
        self._start = time.perf_counter()
        self._samples = 0
        if self.bar_enabled:
            self._bar = tqdm(
                total=batches,
                initial=done,
                desc=f"epoch {epoch + 1}/{epochs}",
                unit="batch",
                leave=False,
                dynamic_ncols=True,
            )

    def step(self, step: int, samples: int, loss: torch.Tensor) -> None:
        self._samples += samples
        if self._bar is None:
            return
        self._bar.update(1)
        if step % POSTFIX_EVERY == 0:
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            self._bar.set_postfix(loss=f"{loss.item():.4f}", samples_per_s=f"{self._samples / elapsed:,.0f}")

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
