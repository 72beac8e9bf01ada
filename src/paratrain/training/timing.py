"""Where a training step's time goes: waiting for data, forward, backward, the optimizer step, and the rest.

    timer = StepTimer(par.device)
    for batch in timer.data(loader):    # 'rest' since the previous step, then 'data' while the batch arrives
        ...; timer.lap("forward")         # each lap charges the time since the previous lap to a phase
        ...; timer.lap("backward")        # with accumulation, forward and backward laps alternate
        ...; timer.lap("optimizer")
    timer.stop()                          # end of the epoch's steps (before evaluation and checkpoints)
    breakdown = time_breakdown(par, timer)   # every rank's averages, on every rank (one gather)

On the CPU the laps read the host clock. On a GPU work is asynchronous, so a host clock would time kernel
launches: each lap records a CUDA event instead, and the events are read only at :meth:`StepTimer.flush` (the
end of each logged interval), so the step never waits for the GPU because of the timer. ``backward`` includes
gradient synchronisation that did not overlap with it (our DDP waits for its buckets at the end of backward).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

import torch

from paratrain.parallel import Parallel

__all__ = ["PHASES", "StepTimer", "time_breakdown"]

PHASES = ("data", "forward", "backward", "optimizer", "rest")
_MAX_PENDING = 4096  # CUDA events held before reading them anyway (a long --log-every must not hoard events)
T = TypeVar("T")


class StepTimer:
    """Seconds per phase, summed over the steps timed (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.steps = 0
        self._mark: Any = None  # the clock reading (or CUDA event) of the latest lap; None between epochs
        self._pending: list[tuple[str, Any, Any]] = []  # CUDA: (phase, start event, end event) not yet read

    @property
    def elapsed(self) -> float:
        """Seconds of every step timed so far (CUDA: as of the latest :meth:`flush`)."""
        return sum(self.totals.values())

    @property
    def clock(self) -> str:
        return "cuda events" if self.cuda else "host"

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = self._now()
        if self._mark is not None:
            if self.cuda:
                self._pending.append((phase, self._mark, now))
                if len(self._pending) >= _MAX_PENDING:
                    self.flush()
            else:
                self.totals[phase] += now - self._mark
        self._mark = now

    def data(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, with the wait for each charged to ``data`` and the time between steps to ``rest``."""
        self._mark = self._now()
        iterator = iter(batches)
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                self._mark = None
                return
            self.lap("data")
            self.steps += 1
            yield batch
            self.lap("rest")

    def stop(self) -> None:
        """The steps of this epoch are over: charge what followed the last lap to ``rest``, stop timing."""
        if self._mark is not None:
            self.lap("rest")
        self._mark = None

    def flush(self) -> None:
        """Read the CUDA events recorded so far (waits for the last one); nothing to do on the host clock."""
        if not self._pending:
            return
        self._pending[-1][2].synchronize()
        for phase, start, end in self._pending:
            self.totals[phase] += start.elapsed_time(end) / 1000.0  # milliseconds
        self._pending.clear()


def time_breakdown(par: Parallel, timer: StepTimer) -> dict[str, Any]:
    """Every rank's average seconds per step in each phase, each phase's share of the step, and the seconds the rank
    waited for the others in collectives (the rank that waits least is the one the others wait for).

    A collective under ddp (one gather of a small tensor): call it in every process.
    """
    timer.flush()
    row = [timer.steps, par.collective_wait_seconds, *(timer.totals[p] for p in PHASES)]
    mine = torch.tensor([row], dtype=torch.float64, device=par.device)
    ranks = []
    for rank, row in enumerate(par.gather(mine).tolist()):
        steps, waited, seconds = int(row[0]), row[1], row[2:]
        step = sum(seconds)
        ranks.append(
            {
                "rank": rank,
                "steps": steps,
                "step_seconds": step / steps if steps else 0.0,
                "collective_wait_seconds": waited,
                "seconds": {p: s / steps if steps else 0.0 for p, s in zip(PHASES, seconds, strict=True)},
                "shares": {p: s / step if step else 0.0 for p, s in zip(PHASES, seconds, strict=True)},
            }
        )
    return {"clock": timer.clock, "phases": list(PHASES), "ranks": ranks}
