"""A failed job in a few lines: each worker's last error, recorded where torchrun collects it, and one line per
failed rank from the launcher.

    record_error("ConfigError: --model mynets:small ...")    # in a worker: torchrun's error file for this rank
    for line in summary_lines(child_failed_error): print(line)  # in the launcher, instead of torchrun's traceback

torchrun ends a failed job with a ``ChildFailedError`` traceback and a table of every failure, about 45 lines in
which the error itself does not appear (without torch's ``@record`` decorator on the script's main function
the table says "To enable traceback see ..."). Each rank's error is recorded here in the file torchrun names in
``TORCHELASTIC_ERROR_FILE`` (its own format, so its table shows it too), by paratrain's worker and, for any
script, by :mod:`paratrain.launch.script`; the launcher prints one line per failed rank and writes the whole report to
a log file it names.
"""

from __future__ import annotations

import hashlib
import os
import signal
from typing import Any

from paratrain.diagnostics.error_file import error_line, record_error
from paratrain.environment import ClusterEnvironment
from paratrain.files import JOB_DIR_ENV

__all__ = [
    "EXIT_OUTPUT_CLOSED",
    "error_line",
    "exit_code_of",
    "first_failure",
    "first_to_show",
    "is_shown_marker",
    "output_closed",
    "record_error",
    "summary_lines",
]

EXIT_OUTPUT_CLOSED = 128 + signal.SIGPIPE.value  # 141: a Unix tool whose output's reader went away
_STOPPED = (-signal.SIGTERM, -signal.SIGKILL)  # how torchrun stops the other workers after a failure
_NO_RECORD = "To enable traceback see"  # what torchrun's table says for a rank that recorded nothing


_SHOWN = "shown-"  # a marker in the job's directory: this traceback was printed by a rank of this node


def first_to_show(text: str) -> bool:
    """Whether this worker is the first of its job on this machine to fail with exactly ``text`` (a traceback), in
    this start of the workers: it prints it, the others do not (every rank failing on the same line of a script
    would print the same traceback, once per rank). True outside paratrain's launcher, and when the job's
    directory cannot be written."""
    job = os.environ.get(JOB_DIR_ENV)
    if not job:
        return True
    attempt = ClusterEnvironment.detect().restart_count
    digest = hashlib.sha256(f"{attempt}\n{text}".encode()).hexdigest()[:16]
    try:
        os.close(os.open(os.path.join(job, f"{_SHOWN}{digest}"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


def is_shown_marker(name: str) -> bool:
    """Whether a file of the job's directory is one of :func:`first_to_show`'s markers (removed at the job's end)."""
    return name.startswith(_SHOWN)


def exit_code_of(exitcode: int) -> int:
    """A worker's exit code as a shell reports it: 128 + N for a worker that signal N ended."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _ended(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def first_failure(failures: dict[int, Any]) -> int:
    """The rank whose failure ended the job: the earliest (``timestamp``) of those the launcher did not stop.

    torchrun's own choice is the earliest of all, which can be a rank it stopped with SIGTERM after another failed
    (its error file written just before the stop reached it): the job would then exit as if killed by SIGTERM
    (143) although a rank exited with its own code. A rank killed by SIGKILL stays a candidate: that is how a rank
    killed from outside (the machine's OOM killer, a fault) ends, and the launcher sends it only to a rank that
    outlived SIGTERM by the shutdown timeout, long after the failure it stops the job for."""
    own = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
    return min(own, key=lambda rank: (own[rank].timestamp, rank))


def output_closed(failures: dict[int, Any], first: int) -> bool:
    """True when the job failed only because its output's reader went away (``paratrain train ... | head``):
    the first failed rank ended as a closed pipe ends a process (exit 141, or killed by SIGPIPE), and every other
    failed rank did too or was stopped by the launcher afterwards."""

    def closed(exitcode: int) -> bool:
        return exit_code_of(exitcode) == EXIT_OUTPUT_CLOSED

    others = (failure.exitcode for rank, failure in failures.items() if rank != first)
    return closed(failures[first].exitcode) and all(closed(code) or code in _STOPPED for code in others)


def summary_lines(failures: dict[int, Any], first: int) -> list[str]:
    """One line per failed rank, the first failure (``first``) first; ``failures`` maps each global rank to
    torchrun's ``ProcessFailure`` (``exitcode``, ``message``, ``timestamp``)."""
    root = failures[first]
    lines = [f"rank {first} {_ended(root.exitcode)}: {_last_line(root.message)}"]
    for rank in sorted(failures):
        if rank == first:
            continue
        failure = failures[rank]
        if failure.exitcode in _STOPPED:
            lines.append(f"rank {rank} was stopped by the launcher after rank {first} failed")
        else:
            lines.append(f"rank {rank} {_ended(failure.exitcode)}: {_last_line(failure.message)}")
    return lines


def _last_line(message: Any) -> str:
    if isinstance(message, dict):  # what an error file holds: {"message": ..., "extraInfo": {...}}
        message = message.get("message", "")
    text = str(message or "").strip()
    if not text or _NO_RECORD in text:
        return "it recorded no error (its own output above says why)"
    if text.startswith("Signal ") and "received by PID" in text:
        return text
    return text.splitlines()[-1]
