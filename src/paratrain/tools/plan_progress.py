"""What ``paratrain plan`` is doing while it measures: one line per phase, with what is left, on stderr.

    progress = PhaseProgress(["measuring compute", "measuring single", "measuring ddp:2"], enabled=True)
    progress.start("measuring single")     # plan: measuring single (2 of 3)...
    progress.done()                          # plan: done in 41 s

On a terminal the line updates in place (carriage return, the line cleared); otherwise each phase is a line of
its own, so that a log or a pipe shows every phase. Phases may be added as they become known (:meth:`add`).
stdout stays the report's alone.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["PhaseProgress"]


class PhaseProgress:
    """Reports each phase as it starts, numbered out of all the phases known so far."""

    def __init__(self, phases: list[str], *, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.phases = list(phases)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.in_place = enabled and self.stream.isatty()
        self.started = time.perf_counter()
        self.current = 0  # how many phases have started
        self._width = 0  # the length of the line shown in place

    def add(self, phase: str) -> None:
        """A phase not known when the plan began (added before it starts)."""
        self.phases.append(phase)

    def drop(self, phase: str) -> None:
        """A phase that will not run after all (if it has not started)."""
        if phase in self.phases[self.current :]:
            self.phases.remove(phase)

    def start(self, phase: str) -> None:
        """``phase`` begins: ``plan: PHASE (i of n)...`` with the seconds so far."""
        if phase not in self.phases[self.current :]:
            self.phases.insert(self.current, phase)
        self.current = self.phases.index(phase, self.current) + 1
        elapsed = time.perf_counter() - self.started
        self._show(f"plan: {phase} ({self.current} of {len(self.phases)}, {elapsed:.0f} s so far)...")

    def done(self) -> None:
        """All phases finished: the line on a terminal is replaced by the total time, kept."""
        if self.enabled:
            self._show(f"plan: done in {time.perf_counter() - self.started:.0f} s")
            if self.in_place:
                self.stream.write("\n")
                self.stream.flush()

    def _show(self, text: str) -> None:
        if not self.enabled:
            return
        if self.in_place:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
