"""What a restart costs: the progress a run leaves beside its checkpoints, and the recovery a restart records.

When a worker dies and the launcher restarts the workers (``--max-restarts``), the restarted workers resume from
the latest checkpoint, so the steps between that checkpoint and the failure are trained again. To report that
honestly, the main process keeps ``progress.json`` in the checkpoint directory: the last step it finished and
when, plus every recovery so far. It is written after every step (a few hundred bytes overwritten in place
with one ``pwrite``; created atomically first), so a worker killed at any moment leaves the exact
step. A restarted run reads it and records, once its first step after resuming is done (or at its end, when
the failure came after the last step):

- ``steps_redone``: the steps between the checkpoint it resumed from and the last step finished before the
  failure (work lost to the failure);
- ``recovery_seconds``: from that last step to the first step after resuming (detecting the failure, stopping
  and restarting the workers, loading the checkpoint, and the first step again). Times are wall-clock seconds,
  so across machines they carry the machines' clock difference.

    log = ProgressLog(Path("runs/a"), enabled=par.is_main, run_id=par.environment.run_id)
    log.interrupted()                              # this launch's record, unfinished: a re-formed group
    log.start(150, continuing=True)                # a restarted attempt, resumed at global step 150
    log.step(151)                                  # after every optimizer step: one small pwrite
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paratrain.files import atomic_writer

__all__ = ["PROGRESS_FILE", "ProgressLog", "Recovery"]

PROGRESS_FILE = "progress.json"


@dataclass(frozen=True)
class Recovery:
    """One restart: which attempt, from which step, how much work was redone and how long it took."""

    restart: int
    resumed_at_step: int
    steps_redone: int
    recovery_seconds: float


class ProgressLog:
    """The main process's record of its progress and recoveries in ``directory/progress.json``."""

    def __init__(self, directory: Path | None, *, enabled: bool, run_id: str | None) -> None:
        self.path = directory / PROGRESS_FILE if directory is not None and enabled else None
        self.run_id = run_id
        self._previous = self._read()
        self.recoveries: list[Recovery] = []
        self.run_started_at = 0  # the global step this run started at, across restarts
        self._last_step, self._last_time = 0, 0.0
        self._pending: tuple[int, int] | None = None  # (restart, resumed-at step) until the first step is done
        self._fd: int | None = None  # the record, open for writing in place once it exists
        self._size = 0  # bytes written last: a shorter record is padded with spaces to cover it

    def _read(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            found = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}  # none yet, or unreadable: the recovery figures are then simply not known
        return found if isinstance(found, dict) else {}

    def interrupted(self) -> bool:
        """True when the record is this launch's (``run_id``) and says it did not finish: a group re-formed after
        a failure or a change of nodes, whatever restart count the launcher gave."""
        previous = self._previous
        return bool(self.run_id) and previous.get("run_id") == self.run_id and previous.get("finished") is False

    def start(self, at_step: int, *, continuing: bool) -> None:
        """This attempt starts at global step ``at_step``; ``continuing``: it continues an interrupted attempt of
        the same run (a restart), whose record it extends, else the record starts afresh.

        A continuing attempt keeps :attr:`run_started_at` where the first attempt started, so limits such as
        ``--max-steps`` end every attempt at the same step, and records its recovery at its first step.
        """
        previous = self._previous if continuing else {}
        self.recoveries = [Recovery(**r) for r in previous.get("recoveries", [])]
        self._last_step = int(previous.get("global_step", 0))
        self._last_time = float(previous.get("time", 0.0))
        started = previous.get("run_started_at")
        self.run_started_at = started if continuing and isinstance(started, int) else at_step
        self._pending = (len(self.recoveries) + 1, at_step) if continuing and self.path is not None else None

    def step(self, global_step: int) -> None:
        """An optimizer step finished: complete a pending recovery; write the progress (one pwrite)."""
        now = time.time()
        if self._pending is not None:
            self._recovered(now)
        self._write(global_step, now)

    def finish(self, global_step: int) -> None:
        """The run ends: record where, and that it finished (a later launch with the same id starts anew).

        A restart that had no step left to do (the worker died after the last one) recovers here."""
        now = time.time()
        if self._pending is not None:
            self._recovered(now)
        self._write(global_step, now, finished=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _recovered(self, now: float) -> None:
        assert self._pending is not None
        restart, from_step = self._pending
        redone = max(0, self._last_step - from_step) if self._last_time else 0
        took = now - self._last_time if self._last_time else 0.0
        self.recoveries.append(Recovery(restart, from_step, redone, round(took, 3)))
        self._pending = None

    def _write(self, global_step: int, now: float, *, finished: bool = False) -> None:
        if self.path is None:
            return
        payload = {
            "run_id": self.run_id,
            "finished": finished,
            "global_step": global_step,
            "time": now,
            "run_started_at": self.run_started_at,
            "recoveries": [asdict(r) for r in self.recoveries],
        }
        data = json.dumps(payload).encode()
        data = data.ljust(max(len(data), self._size))  # trailing spaces: still the same JSON
        try:
            if self._fd is None:
                with atomic_writer(self.path, "wb") as file:  # a new file whole, never half of one
                    file.write(data)
                self._fd = os.open(self.path, os.O_WRONLY)
            else:
                os.pwrite(self._fd, data, 0)  # one write of a few hundred bytes: a kill cannot split it
            self._size = len(data)
        except OSError:
            pass  # progress is informational: a failed write must not stop training
