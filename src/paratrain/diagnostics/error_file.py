"""A worker's last error, where torchrun collects it, for the launcher's summary (launch.failures).

    record_error(error_line(exc))         # in a worker: torchrun's error file for this rank (none outside torchrun)

Kept apart from the launcher so that the engine's collectives, which end a process from the board's thread after
a hang report, record their short line without depending on the launcher.
"""

from __future__ import annotations

import json
import os
import time
import traceback

from paratrain.files import atomic_writer

__all__ = ["error_line", "record_error"]


def record_error(message: str) -> None:
    """Record ``message`` as this worker's error in torchrun's error file (nothing outside a torchrun worker).

    The file is replaced whole, and a symbolic link found at its path is replaced, never followed."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))},
        }
    }
    try:
        with atomic_writer(path, "w", follow_links=False) as file:
            json.dump(data, file)
    except OSError:  # the summary then says less; the error itself was printed by the worker
        pass


def error_line(exc: BaseException) -> str:
    """What to record of ``exc`` for the launcher's summary: its type and message, or for an error whose message
    was printed whole already (a :class:`paratrain.errors.CollectiveError`, with its hang report) its short
    ``summary``, which points there."""
    summary = getattr(exc, "summary", None)
    return f"{type(exc).__name__}: {summary if isinstance(summary, str) and summary else exc}"
