"""Progress for the main process: a tqdm bar per epoch, the tutorial's loss line, epoch summaries.

The bar goes to stderr and only when it is a terminal; log lines go to stdout through ``tqdm.write`` so they
do not tear the bar. Reading a loss value synchronises a GPU, so the bar reads it only every few steps. Epochs
are numbered as in the tutorial's ``Epoch E, Step S`` line, from 0.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

__all__ = ["EXIT_BROKEN_PIPE", "Progress", "stdout_closed"]

POSTFIX_EVERY = 10
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what a Unix tool whose reader went away exits with


def stdout_closed() -> int:
    """Standard output's reader went away (``paratrain train | head -2``): the exit code to end quietly with,
    141, as a Unix tool that SIGPIPE ended.

    Python would also report the failed flush of stdout at exit; stdout is pointed at /dev/null first.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout to replace (captured by a test, say)
        pass
    return EXIT_BROKEN_PIPE


class Progress:
    """Reports a run's progress; everything is a no-op outside the main process."""

    def __init__(
        self,
        *,
        enabled: bool,
        bar: bool | None = None,
        log: Callable[[str], None] | None = None,
        stderr: bool = False,
    ) -> None:
        """``stderr``: log lines go there (the results are written to stdout, which must stay parseable)."""
        self.enabled = enabled
        self._stream = sys.stderr if stderr else None
        self.bar_enabled = enabled and (sys.stderr.isatty() if bar is None else bar)
        self._log = log
        self._bar: tqdm | None = None
        self._start = 0.0
        self._samples = 0
        self._loss: float | None = None  # the latest loss given as a number (the logged global one under ddp)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self._log is not None:
            self._log(line)
        elif self._bar is not None:
            tqdm.write(line)
        else:
            print(line, flush=True, file=self._stream)

    def start_epoch(self, epoch: int, epochs: int, batches: int, done: int = 0) -> None:
        self._start = time.perf_counter()
        self._samples = 0
        if self.bar_enabled:
            self._bar = tqdm(
                total=batches,
                initial=done,
                desc=f"Epoch {epoch}",
                unit="batch",
                leave=False,
                dynamic_ncols=True,
            )

    def step(self, step: int, samples: int, loss: torch.Tensor | float | None) -> None:
        """Batch ``step`` of the epoch is done: ``loss`` is its loss (a tensor, read every few steps), a number
        to show from now on, or None to keep showing the latest number."""
        self._samples += samples
        if isinstance(loss, float):
            self._loss = loss
        if self._bar is None:
            return
        self._bar.update(1)
        if step % POSTFIX_EVERY == 0:
            elapsed = max(time.perf_counter() - self._start, 1e-9)
            shown = loss.item() if isinstance(loss, torch.Tensor) else self._loss
            loss_text = {} if shown is None else {"loss": f"{shown:.4f}"}
            self._bar.set_postfix(**loss_text, samples_per_s=f"{self._samples / elapsed:,.0f}")

    def end_epoch(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
