"""Where a process is: its Python stacks (every thread), and for a process that cannot answer, what the system says.

    python_stacks()                      # this process: [{"thread": "MainThread", "frames": [...]}, ...]
    calling()                            # ("par.barrier()", "train.py:40"): the paratrain call this thread is in
    UserLine()()                         # "train.py:40", cheap when called along the same path each time
    arm_signal_dump()                    # SIGUSR1 then writes every thread's stack to a file (faulthandler)
    is_stack_file("paratrain-stacks-41-k2x9.txt")   # True: a name arm_signal_dump gives
    drop_unused_dump()                   # before os._exit, which skips atexit: the file goes while it is empty
    process_state(pid)                   # "running", "sleeping", "stopped", ... or None when it is gone
    signal_dump(pid, path)               # ask an armed process on this machine for its stacks, read them back

A rank answers the hang report from its board's thread (:mod:`paratrain.diagnostics.hang_report`), which runs while
the main thread sleeps, waits in a collective or loops in Python. A rank whose main thread holds the GIL inside native
code cannot answer from Python; faulthandler's signal handler still can, so ranks arm it and a rank on the same
machine asks through the signal. A stopped process (SIGSTOP) answers nothing until it is continued: its state
says so.

The stack file is created with an unpredictable name, exclusively and with mode 0600 (a link planted at any name
is never followed) in :func:`paratrain.files.scratch_directory`. It is removed when the process exits (Python's
exit, and paratrain's own ``os._exit`` calls, not a kill) while it is still empty; once it holds stacks (a hang
report took them through the signal, and names the file) it stays.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import IO, Any

from paratrain.files import scratch_directory

__all__ = [
    "PACKAGE_DIR",
    "STACKS_PREFIX",
    "TORCH_DIR",
    "TORCH_DIRS",
    "UserLine",
    "arm_signal_dump",
    "calling",
    "drop_unused_dump",
    "is_stack_file",
    "process_state",
    "python_stacks",
    "signal_dump",
    "user_frame",
]

STACKS_PREFIX = "paratrain-stacks-"  # then the pid, a dash, random characters and .txt

_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in uninterruptible sleep (disk or device)",
    "T": "stopped (SIGSTOP or a terminal signal)",
    "t": "stopped by a debugger",
    "Z": "gone (a zombie: exited, not yet reaped)",
    "X": "gone",
    "I": "idle",
}


class _SignalDump:
    """The process's one SIGUSR1 stack dump: a signal handler belongs to the process, as faulthandler's state does."""

    def __init__(self) -> None:
        self.path: Path | None = None
        self.file: IO[str] | None = None


_SIGNAL_DUMP = _SignalDump()
PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)  # frames inside paratrain are not the user's line
TORCH_DIR = str(Path(str(__import__("torch").__file__)).resolve().parent)
# torch's frames name it as imported, which is not the resolved path where a virtual environment is a link
TORCH_DIRS = (TORCH_DIR, str(Path(str(__import__("torch").__file__)).parent))
# frames that are not the user's: paratrain's, torch's, the standard library's, and frozen or generated code
_NOT_USERS = (PACKAGE_DIR, *TORCH_DIRS, os.path.dirname(os.__file__), "<")


def python_stacks() -> list[dict[str, Any]]:
    """Every thread's Python stack in this process, innermost frame last."""
    names = {t.ident: (t.name, t.daemon) for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        name, daemon = names.get(ident, (f"thread {ident}", True))
        frames = [
            {"file": f.filename, "line": f.lineno, "function": f.name, "code": (f.line or "").strip()}
            for f in traceback.extract_stack(frame)
        ]
        stacks.append({"thread": name, "daemon": daemon, "frames": frames})
    stacks.sort(key=lambda s: (s["thread"] != "MainThread", s["daemon"], s["thread"]))
    return stacks


def calling() -> tuple[str, str]:
    """The paratrain call this thread is in and the user's line that made it: (``par.barrier()``, ``train.py:40``).

    Read from the live frames (no traceback objects, no source lines): a few microseconds, cheap enough for each
    collective a user calls and each training forward. The call is the outermost paratrain frame's function
    (``par.NAME()`` for one of :class:`paratrain.Parallel`'s); ``("", "")`` outside paratrain or without a user's
    frame."""
    frame: FrameType | None = sys._getframe(1)
    ours: FrameType | None = None
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGE_DIR):
            ours = frame
        elif not path.startswith(_NOT_USERS):
            break
        frame = frame.f_back
    if frame is None or ours is None:
        return "", ""
    name = "close" if ours.f_code.co_name == "__exit__" else ours.f_code.co_name  # a `with Parallel(...)` block ends
    call = f"par.{name}()" if ours.f_code.co_filename.endswith("parallel.py") else f"paratrain's {name}()"
    return call, f"{frame.f_code.co_filename}:{frame.f_lineno}"


class UserLine:
    """The user's line of a call made along the same path again and again (each training forward), for a hook deep
    inside it: found by walking up the frames once, then looked up at the same depth (two frames materialised, not
    every one on the way: well under a microsecond), and walked again wherever the path differs.

        line = UserLine()
        line()                           # "train.py:40": the innermost frame outside paratrain, torch, the stdlib
    """

    def __init__(self) -> None:
        self._depth: int | None = None  # frames from the caller of __call__ up to the user's

    def __call__(self) -> str:
        depth = self._depth
        if depth is not None:
            try:
                inner, frame = sys._getframe(depth + 1), sys._getframe(depth + 2)
            except ValueError:  # a shallower stack than last time: walked below
                pass
            else:
                user = frame.f_code.co_filename
                if inner.f_code.co_filename.startswith(_NOT_USERS) and not user.startswith(_NOT_USERS):
                    return f"{user}:{frame.f_lineno}"
        walked: FrameType | None = sys._getframe(1)
        depth = 0
        while walked is not None and walked.f_code.co_filename.startswith(_NOT_USERS):
            walked, depth = walked.f_back, depth + 1
        if walked is None:
            self._depth = None
            return ""
        self._depth = depth - 1 if depth > 0 else None  # called from the user's own frame: nothing inner to check
        return f"{walked.f_code.co_filename}:{walked.f_lineno}"


def user_frame(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The innermost frame outside paratrain, torch and the standard library: the user's line, if any."""
    for frame in reversed(frames):
        path = str(frame.get("file", ""))
        if path.startswith(_NOT_USERS):
            continue
        found: dict[str, Any] = frame
        return found
    return None


def arm_signal_dump() -> str | None:
    """Make SIGUSR1 write every thread's stack to a file, once per process; returns the file's path.

    Only where SIGUSR1 is not taken (its handler is the default, which would end the process): a user's handler
    is never replaced. None when it cannot be armed (taken, not the main thread, or no SIGUSR1 here). The file is
    new (see the module docstring) and removed at the process's exit unless it holds stacks.
    """
    if _SIGNAL_DUMP.path is not None:
        return str(_SIGNAL_DUMP.path)
    if not hasattr(signal, "SIGUSR1") or threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        return None
    try:
        fd, name = tempfile.mkstemp(prefix=f"{STACKS_PREFIX}{os.getpid()}-", suffix=".txt", dir=scratch_directory())
    except OSError:
        return None
    path = Path(name)
    file: IO[str] = os.fdopen(fd, "w")  # faulthandler writes to it for the process's lifetime
    try:
        faulthandler.register(signal.SIGUSR1, file=file, all_threads=True, chain=False)
    except (OSError, RuntimeError, ValueError):
        file.close()
        path.unlink(missing_ok=True)
        return None
    _SIGNAL_DUMP.path, _SIGNAL_DUMP.file = path, file
    atexit.register(drop_unused_dump)
    return str(path)


def is_stack_file(name: str) -> bool:
    """True when ``name`` is one :func:`arm_signal_dump` gives (``paratrain-stacks-PID-RANDOM.txt``)."""
    pid, _, rest = name.removeprefix(STACKS_PREFIX).partition("-")
    return name.startswith(STACKS_PREFIX) and pid.isdigit() and rest.endswith(".txt")


def drop_unused_dump() -> None:
    """At exit: the stack file goes unless it holds stacks (someone asked for them, a hang report names it).

    Runs at Python's exit; call it before ``os._exit``, which skips that. The handler stays registered and the
    file open: SIGUSR1 must not end the process while it exits, and faulthandler keeps writing to the file it
    holds (unlinked, then)."""
    path, file = _SIGNAL_DUMP.path, _SIGNAL_DUMP.file
    if path is None or file is None:
        return
    with contextlib.suppress(OSError, ValueError):
        if os.fstat(file.fileno()).st_size == 0:
            path.unlink()


def process_state(pid: int) -> str | None:
    """What the kernel says process ``pid`` (on this machine) is doing; None when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return _STATES.get(fields[0], f"state {fields[0]}")


def signal_dump(pid: int, path: str, wait: float = 1.0) -> str | None:
    """Ask armed process ``pid`` for its stacks through SIGUSR1; the text it wrote, or None when it did not."""
    target = Path(path)
    with contextlib.suppress(OSError):
        before = target.stat().st_size
        os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            time.sleep(0.05)
            if target.stat().st_size > before:
                time.sleep(0.1)  # let it finish writing
                with open(target) as file:
                    file.seek(before)
                    return file.read()
    return None
