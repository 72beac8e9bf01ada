"""Run a child process the way a launcher should: its own session, signals forwarded once, a deadline.

    code = supervise([sys.executable, "-m", "torch.distributed.run", ...], env=env, timeout=600)

The child (torchrun) starts in its own session, so a Ctrl-C in the terminal reaches this process only; the
first SIGINT, SIGTERM, SIGHUP or SIGQUIT is forwarded to the child once, after which it stops its own workers.
A second signal is not forwarded: it would cut that shutdown short and could leave workers running. A second
Ctrl-C means "now": the child and every process below it (torchrun's workers run in sessions of their own) are
killed at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType

__all__ = ["supervise"]

# the signals torchrun itself forwards to its workers (its --signals-to-handle default)
_FORWARDED_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
# torchrun gives its workers 30 s to exit after a signal before it kills them; allow that and a margin
_SHUTDOWN_GRACE_S = 45.0


def supervise(command: Sequence[str], *, env: Mapping[str, str], timeout: float | None = None) -> int:
    """Run ``command`` to the end and return its exit code (128 + N when a signal N ended it).

    After a forwarded SIGINT this raises ``KeyboardInterrupt``. Past ``timeout`` seconds the child is stopped
    (SIGTERM, then SIGKILL after a grace period) and ``subprocess.TimeoutExpired`` is raised. Signals are only
    forwarded when called from the main thread.
    """
    process = subprocess.Popen(list(command), start_new_session=True, env=dict(env))
    forwarded: list[int] = []
    try:
        with _forward_signals(process, forwarded):
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(process)
                raise
    finally:
        if process.poll() is None:  # an unexpected exception while waiting: leave nothing running
            _stop(process)
    if forwarded:
        if forwarded[0] == signal.SIGINT:
            raise KeyboardInterrupt
        return 128 + forwarded[0]
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM torchrun (it stops its workers), then SIGKILL it if it is still there after the grace period."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=_SHUTDOWN_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def _forward_signals(process: subprocess.Popen[bytes], forwarded: list[int]) -> Iterator[None]:
    """While inside, forward the first of torchrun's signals to ``process``, once; ignore repeats."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: FrameType | None) -> None:
        if forwarded and signum == forwarded[0] == signal.SIGINT:  # Ctrl-C twice: leave now
            print("paratrain: interrupted again: stopping every process of the job now", file=sys.stderr)
            _kill_tree(process.pid)
            return
        if forwarded:  # torchrun is already shutting its workers down; a second signal would cut that short
            print(
                f"paratrain launch: already stopping the job (got {signal.Signals(signum).name} again); "
                "waiting for torchrun to end its workers",
                file=sys.stderr,
            )
            return
        forwarded.append(signum)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    previous = {}
    for signum in _FORWARDED_SIGNALS:
        handler = signal.getsignal(signum)
        if handler is signal.SIG_IGN or handler is None:  # ignored on purpose (nohup), or set outside Python
            continue
        previous[signum] = handler
        signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it, found in /proc (only ``pid`` where there is no /proc)."""
    victims = [pid]
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            # the command name may hold spaces and parentheses: the fields after its last ")" are safe
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        parents.setdefault(parent, []).append(int(entry.name))
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            victims.append(child)
            todo.append(child)
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
