"""torchrun with three of its defects mended: ``python -m paratrain.launch.torchrun [OPTIONS] -- TORCHRUN_ARGS``.

``launch()`` runs this module instead of ``python -m torch.distributed.run``; everything after ``--`` is torchrun's
own command line, unchanged. Each mend changes one of torchrun's internals (torch 2.13) and is skipped, leaving
torchrun as it is, when those internals are not what it expects:

``--grace SECONDS``
    torchrun reads a shutdown grace (``--shutdown-timeout``) but uses it only when it is interrupted: when a
    worker fails, and between restarts, its process context stops the other workers with a fixed 30 s grace.
    A stopped (SIGSTOP) or hung worker only goes with the SIGKILL at the end of it, so a hang that a rank had
    detected and reported kept the job alive 30 s more. Every stop uses this grace instead, but for Ctrl-C
    (SIGINT), which gives the workers at least ``INTERRUPT_GRACE_S`` to save where they are; a worker that is
    stopped (which SIGTERM cannot reach) is killed at once.
``--fresh-store``
    The store the workers meet in (their ``MASTER_PORT``) is created once and kept across restarts, and the
    workers' keys carry no attempt prefix: restarted workers read the dead workers' gloo addresses and fail
    ("Connection refused") or hang forever (13 of 20 restarts here), and a node joining a running elastic job
    waits for bootstrap keys that are never written. Each rendezvous round gets a new, empty store.
``--bind ADDRESS``
    A store server listens on every interface whatever address it is given; only a socket bound beforehand
    (``master_listen_fd``) chooses. Every store server torchrun starts is bound to ADDRESS (127.0.0.1 for a
    job on one machine, so nothing outside it can reach the job).

It also reports the job's end in a few lines (``--name`` is the command they name): torchrun's own log goes to a
file instead of the terminal; a failed job prints one line per failed rank, with the rank's exit code or signal
and its error's last line (:mod:`paratrain.launch.failures`), names that file, and exits with the first failed rank's
code, instead of torchrun's ``ChildFailedError`` traceback; a job stopped by a signal (Ctrl-C) exits with
128 + the signal's number, quietly, since its workers said where they stopped. A job whose output's reader went
away (``paratrain train ... | head``: the rank that printed exited 141, the others were stopped) ends quietly
with 141 too, as one process would. A port node 0 cannot listen on because another program holds it ends with
``EXIT_PORT_TAKEN`` and no traceback (``launch()`` says which port, and what to pass).

Everything the job writes for itself goes in one new private directory (``mkdtemp``: an unpredictable name, mode
0700) in the temporary directory, ``paratrain-launch-XXXXXXXX``: torchrun's log (``torchrun.log``), torchrun's
``--log-dir`` (``torchrun/``: the workers' error files), and the workers' stack files (they find the directory in
``PARATRAIN_JOB_DIR``). At the job's end what no line names is removed: everything after a success or a
signal, the empty stack files after a failure; the directory itself when nothing is left in it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paratrain.diagnostics.stacks import is_stack_file
from paratrain.files import JOB_DIR_ENV
from paratrain.launch.config import EXIT_PORT_TAKEN, EXIT_RENDEZVOUS_FAILED
from paratrain.launch.failures import (
    EXIT_OUTPUT_CLOSED,
    exit_code_of,
    first_failure,
    is_shown_marker,
    output_closed,
    summary_lines,
)

# after Ctrl-C the workers stop after a step they agree on and save a checkpoint, which a loaded machine or a big
# model makes slow: they get this long at least (a second Ctrl-C ends them at once)
INTERRUPT_GRACE_S = 60


def _one_grace(seconds: int) -> None:
    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:
        return
    original = getattr(PContext, "close", None)
    if original is None:
        return

    @functools.wraps(original)
    def close(self: Any, death_sig: Any = None, timeout: int = 30) -> Any:
        _kill_the_stopped(self)
        grace = max(seconds, INTERRUPT_GRACE_S) if death_sig == signal.SIGINT else seconds
        return original(self, death_sig, grace)

    PContext.close = close  # type: ignore[method-assign]


def _kill_the_stopped(context: Any) -> None:
    """SIGKILL the workers that are stopped (SIGSTOP): SIGTERM cannot reach them, so the grace would only wait."""
    pids = getattr(context, "pids", None)
    if not callable(pids):
        return
    for pid in dict(pids()).values():
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("T", "t"):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _fresh_store_per_round() -> None:
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler
    except ImportError:
        return
    original = getattr(DynamicRendezvousHandler, "next_rendezvous", None)
    if original is None:
        return

    @functools.wraps(original)
    def next_rendezvous(self: Any) -> Any:
        if hasattr(self, "_bootstrap_store_info") and hasattr(self, "_shared_tcp_store_server"):
            self._bootstrap_store_info = None  # rebuilt for this round: a new port, read afresh by every node
            self._shared_tcp_store_server = None  # the old server closes with its last reference
        return original(self)

    DynamicRendezvousHandler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def _bound_stores(address: str) -> None:
    import torch.distributed as dist

    base = dist.TCPStore  # type: ignore[attr-defined]

    class BoundTCPStore(base):  # type: ignore[misc, valid-type]
        """A TCPStore whose server listens on ``address`` only."""

        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
            if is_master and kwargs.get("master_listen_fd") is None:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.bind((address, port))
                    sock.listen(socket.SOMAXCONN)
                except OSError as exc:
                    sock.close()
                    # the rendezvous falls back to being a client on RuntimeError, as when torch's own bind fails
                    kind = _PortTaken if exc.errno == errno.EADDRINUSE else RuntimeError
                    raise kind(f"cannot listen on {address}:{port}: {exc}") from exc
                port = sock.getsockname()[1]
                kwargs["master_listen_fd"] = sock.detach()  # the store owns the descriptor from here on
            super().__init__(host_name, port, *args, **kwargs)

    modules = ["torch.distributed.elastic.rendezvous.c10d_rendezvous_backend"]
    modules.append("torch.distributed.elastic.rendezvous.static_tcp_rendezvous")
    dist.TCPStore = BoundTCPStore  # type: ignore[attr-defined]
    for name in modules:
        try:
            module = __import__(name, fromlist=["TCPStore"])
        except ImportError:
            continue
        if getattr(module, "TCPStore", None) is base:
            setattr(module, "TCPStore", BoundTCPStore)  # noqa: B010  (the name is looked up there at call time)


class _PortTaken(RuntimeError):
    """The store's port is in use by another program (a RuntimeError, as torch's own failed bind is)."""


def _port_taken(exc: BaseException) -> bool:
    """True for a store server that could not listen because another program holds its port (ours, or torch's)."""
    return isinstance(exc, _PortTaken) or "EADDRINUSE" in str(exc)


def _job_directory() -> Path:
    """A new private directory for the job's own files (see the module docstring), named to its workers."""
    job = Path(tempfile.mkdtemp(prefix="paratrain-launch-"))  # created exclusively, mode 0700
    os.environ[JOB_DIR_ENV] = str(job)
    return job


def _with_log_dir(torchrun_args: list[str], job: Path) -> list[str]:
    """torchrun's arguments with ``--log-dir`` in the job's directory, unless they (or PET_LOG_DIR) choose one.

    torchrun's options come before the script, each as ``--option=value``, as :mod:`paratrain.launch.launcher`
    writes them; without ``--log-dir`` torchrun makes a ``torchelastic_*`` directory it never removes."""
    options = next((i for i, arg in enumerate(torchrun_args) if not arg.startswith("-")), len(torchrun_args))
    chosen = any(arg.split("=", 1)[0] in ("--log-dir", "--log_dir") for arg in torchrun_args[:options])
    if chosen or os.environ.get("PET_LOG_DIR"):
        return torchrun_args
    return [f"--log-dir={job / 'torchrun'}", *torchrun_args]


def _tidy(job: Path, *, keep_logs: bool) -> None:
    """At the job's end: remove what no line named (see the module docstring); the directory if it is empty."""
    for entry in list(job.iterdir()):
        with contextlib.suppress(OSError):
            if is_shown_marker(entry.name):
                entry.unlink()
            elif is_stack_file(entry.name):
                if entry.stat().st_size == 0:  # no one asked for its rank's stacks
                    entry.unlink()
            elif not keep_logs:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    with contextlib.suppress(OSError):
        job.rmdir()  # only when empty


def _log_to_file(name: str, path: Path) -> logging.Handler:
    """torch.distributed's log of this process (the agent's) into the new file ``path``, not the terminal.

    A restart of the workers is still said on the terminal, in one line."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    log = logging.getLogger("torch.distributed")
    for old in [h for h in log.handlers if isinstance(h, logging.StreamHandler)]:
        log.removeHandler(old)
    log.addHandler(handler)
    log.propagate = False
    agent = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent.setLevel(logging.INFO)  # the restart is an info record
    restarts = logging.StreamHandler(sys.stderr)
    restarts.addFilter(lambda record: "will restart worker group" in str(record.msg) and len(record.args or ()) == 4)
    restarts.setFormatter(_RestartFormatter(name))
    agent.addHandler(restarts)
    return handler


class _RestartFormatter(logging.Formatter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def format(self, record: logging.LogRecord) -> str:
        _, state, left, most = (str(a) for a in record.args or ())
        done = int(most) - int(left) + 1
        return f"{self.name}: the workers {str(state).lower()}: restarting them (restart {done} of {most})"


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    split = args.index("--") if "--" in args else len(args)
    parser = argparse.ArgumentParser(prog="python -m paratrain.launch.torchrun")
    parser.add_argument("--grace", type=int)
    parser.add_argument("--fresh-store", action="store_true")
    parser.add_argument("--bind")
    parser.add_argument("--name", default="paratrain launch")
    options = parser.parse_args(args[:split])
    if options.grace is not None:
        _one_grace(options.grace)
    if options.fresh_store:
        _fresh_store_per_round()
    if options.bind:
        _bound_stores(options.bind)
    # imported before the log is redirected: importing torch's agent sets the levels of its loggers
    from torch.distributed.run import main as torchrun_main

    job = _job_directory()
    log_path = job / "torchrun.log"
    handler = _log_to_file(options.name, log_path)
    sys.argv = ["torchrun", *_with_log_dir(args[split + 1 :], job)]
    code, named = 0, True  # an error _run does not expect keeps the log, and names it
    try:
        code, named = _run(torchrun_main, options.name, log_path)
    except BaseException:
        print(f"{options.name}: torchrun's log: {log_path}", file=sys.stderr, flush=True)
        raise
    finally:
        logging.getLogger("torch.distributed").removeHandler(handler)
        handler.close()
        _tidy(job, keep_logs=named)
    if code:
        sys.exit(code)


def _run(torchrun_main: Callable[[], None], name: str, log_path: Path) -> tuple[int, bool]:
    """Run torchrun (its command line in ``sys.argv``); the exit code, and whether a line named ``log_path``."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        torchrun_main()
    except _rendezvous_failures() as exc:
        if _port_taken(exc):  # another program listens on node 0's port: launch() names it, in one line
            return EXIT_PORT_TAKEN, False
        # the nodes never met: launch() says where and for how long they waited; torch's own trace is in the log
        _append(log_path, traceback.format_exc())
        _say(
            f"paratrain.launch.torchrun: the rendezvous failed: {type(exc).__name__}: {exc} "
            f"(torchrun's log: {log_path})"
        )
        return EXIT_RENDEZVOUS_FAILED, True
    except ChildFailedError as exc:
        first = first_failure(exc.failures)
        root = exc.failures[first]
        if output_closed(exc.failures, first):  # `... | head`: the reader has what it wanted; nothing failed
            return EXIT_OUTPUT_CLOSED, False
        _append(log_path, traceback.format_exc())
        for line in summary_lines(exc.failures, first):
            _say(f"{name}: {line}")
        _say(f"{name}: torchrun's full report: {log_path}")
        return exit_code_of(root.exitcode) or 1, True
    except SignalException as exc:
        # torchrun stopped its workers on a signal (the launcher forwarded Ctrl-C): they said where they stopped
        sigval = exc.sigval
        return 128 + (sigval.value if isinstance(sigval, signal.Signals) else signal.SIGINT.value), False
    except SystemExit as exc:  # torchrun's own usage errors, which it printed
        return (exc.code if isinstance(exc.code, int) else int(exc.code is not None)), False
    return 0, False  # the job succeeded: nothing to look for


def _say(line: str) -> None:
    """``line`` on stderr; nothing when stderr's reader went away (``2>&1 | head``), which leaves the exit code
    the job's."""
    try:
        print(line, file=sys.stderr, flush=True)
    except (BrokenPipeError, ValueError):
        with contextlib.suppress(OSError, ValueError):  # the interpreter's own flush at exit would fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())


def _append(path: Path, text: str) -> None:
    with contextlib.suppress(OSError), open(path, "a") as file:
        file.write(text)


def _rendezvous_failures() -> tuple[type[BaseException], ...]:
    """What a failed rendezvous raises: the nodes never met, or (``_PortTaken``) node 0 could not listen."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return (RendezvousError, dist.DistNetworkError, dist.DistStoreError, _PortTaken)


if __name__ == "__main__":
    main()
