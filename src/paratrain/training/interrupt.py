"""Ctrl-C during training: the first stops the run at a step boundary, every rank at the same one; a second, at once.

    with StopRequest(par) as stop:
        for batch in loader:
            ...one optimizer step...
            if stop.due(global_step, started, steps):       # a few attribute reads until a signal arrives
                save(); raise TrainingInterrupted

In one process the run stops after the step during which SIGINT arrived. Under ddp every rank must stop after
the same step, or the ranks that stop would wait in the checkpoint's collectives for one that went on to the
next step's all-reduce. The launcher sends SIGINT to every rank, but each may see it one step apart, so the ranks
agree on the step through the process group's store, and only after a signal arrived: the first rank to
notice proposes "after step S" (``compare_set``, so the first proposal wins), far enough ahead that the others
learn it in time, and a thread in each rank looks for the proposal every 50 ms. Nothing runs between two steps
but the check of a flag, and no collective is added to any step.

Why S is safe: a rank that finished step b has its peers at step b - 1 or b (none can finish step b + 1
without it), so any S > b is still ahead of every rank; S = b + the steps of about half a second leaves the others
that long (ten of their looks at the store) to see it.

Only this process's own SIGINTs count as Ctrl-Cs: a rank that learns of a peer's proposal from the store before
its own SIGINT arrives (the launcher signals every rank, and one may be in a collective when it lands) takes
that SIGINT as the first, not the second, which would end it at once without its slices of the checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from paratrain.checkpoint.file import latest_checkpoint
from paratrain.comm.process_groups import default_store
from paratrain.diagnostics.stacks import drop_unused_dump
from paratrain.parallel import Parallel

__all__ = ["AGREE_WITHIN_S", "StopRequest", "interrupted_message"]

AGREE_WITHIN_S = 0.5  # how far ahead, in seconds of steps, a rank proposes the step every rank stops after
_POLL_S = 0.05  # how often each rank looks for a proposal in the store
_EXIT_INTERRUPTED = 130


class StopRequest:
    """Turns the first SIGINT into a stop after an agreed step, and a second into leaving now (see the module)."""

    def __init__(self, par: Parallel) -> None:
        self._distributed = par.world_size > 1
        env = par.environment
        self._key = f"paratrain/stop/{env.run_id or 'run'}/attempt-{env.restart_count}"
        self._store: Any = None
        self.signals = 0  # SIGINTs this process got (a second leaves now)
        self.proposed = False  # another rank's proposal arrived through the store
        self.stop_after: int | None = None  # the agreed step (global steps done) the run stops after
        self._previous: Any = None
        self._installed = False
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            handler = signal.getsignal(signal.SIGINT)
            if handler is not signal.SIG_IGN:  # ignored on purpose (nohup, a background job): leave it so
                self._previous = handler
                signal.signal(signal.SIGINT, self._on_signal)
                self._installed = True
        if self._distributed:
            self._store = default_store()
            if self._store is not None:
                self._watcher = threading.Thread(target=self._watch, name="paratrain-stop-watch", daemon=True)
                self._watcher.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._closed.set()
        if self._watcher is not None:
            self._watcher.join()
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    @property
    def signalled(self) -> bool:
        """A stop was asked for: a SIGINT arrived here, or another rank's proposal did."""
        return self.signals > 0 or self.proposed

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if self.signals == 1:
            return  # acted on at the next step boundary
        # the second Ctrl-C: leave now. Under ddp a collective may be in flight, which unwinding would wait for
        if self._distributed:
            drop_unused_dump()  # os._exit skips atexit, where the stack file would go
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(_EXIT_INTERRUPTED)
        raise KeyboardInterrupt

    def due(self, steps_done: int, started: float, steps: int) -> bool:
        """Called after every optimizer step (``steps_done`` global steps so far; ``steps`` of them since
        ``time.perf_counter()`` read ``started``): stop the run now?"""
        if self.stop_after is None:
            if not self.signalled:
                return False
            seconds_per_step = (time.perf_counter() - started) / max(steps, 1)
            self.stop_after = self._agree(steps_done, seconds_per_step)
        return steps_done >= self.stop_after

    def _agree(self, steps_done: int, seconds_per_step: float) -> int:
        if self._store is None:  # one process (or no store to agree through): stop after this step
            return steps_done
        ahead = max(1, math.ceil(AGREE_WITHIN_S / max(seconds_per_step, 1e-6)))
        agreed = self._store.compare_set(self._key, "", str(steps_done + ahead))
        return int(agreed)

    def _watch(self) -> None:
        while not self._closed.wait(_POLL_S):
            try:
                if not self._store.check([self._key]):
                    continue
                proposal = int(self._store.get(self._key))
            except Exception:  # the store went away (the job is ending): nothing left to agree on
                return
            self.stop_after = proposal
            self.proposed = True  # not a signal of this process's: its own Ctrl-C is still its first
            return


def interrupted_message(steps_done: int, epoch: int, batch: int, checkpoints: Path | None) -> str:
    """What an interrupted run says: where it stopped, what it saved, and how to continue."""
    where = f"after step {steps_done} (epoch {epoch}, batch {batch})"
    if checkpoints is None:
        return f"Interrupted: stopped {where}; nothing was saved (no --checkpoint-dir), so a new run starts over"
    saved = latest_checkpoint(checkpoints)  # the one just written: a file, or a directory of every rank's slices
    return f"Interrupted: stopped {where} and saved {saved}; the same command with --resume continues from there"
