"""Writing the files a run produces without ever destroying what is not ours.

Every file paratrain writes (checkpoints, metrics, logs, reports) goes through :func:`atomic_writer`:

- a regular file, or nothing yet: the data goes to a temporary file beside it, which is renamed over the target
  once complete, so a reader (or a crash) never sees half a file;
- a device or a pipe (``/dev/null``, ``/dev/stdout``): written through; it is never replaced by a file;
- a symbolic link: followed, on purpose: the file it points to is written (atomically, as above) and the link
  stays a link; unless ``follow_links=False`` (a file in a directory others write, where a link may have been
  planted): then the link is replaced by the file, and what it pointed to is left alone;
- a directory: an error.

The files a process needs only while it runs (faulthandler's stack file, the launcher's log) are created with an
unpredictable name, exclusively (never through a link), in :func:`scratch_directory`: the private directory
(mode 0700) a paratrain launcher made for the job, else the system's temporary directory.

:func:`check_output` says before any work starts whether a path can be written that way, and
:func:`remove_stale_temporaries` clears the temporary files of writers that died (SIGKILL mid-write)::

    check_output("runs/metrics.json", "--metrics-out")          # ConfigError now, not after the run
    with atomic_writer("runs/metrics.json", "w") as f:
        json.dump(result, f)
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from paratrain.errors import ConfigError

__all__ = [
    "JOB_DIR_ENV",
    "atomic_writer",
    "check_input_dir",
    "check_output",
    "fsync_directory",
    "is_stdout",
    "remove_stale_temporaries",
    "resolve_output",
    "scratch_directory",
]

JOB_DIR_ENV = "PARATRAIN_JOB_DIR"  # the job's private directory, which paratrain's launcher makes and removes

_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"
# .<name>.<host>.<pid>.<random>.tmp: a leading dot and a .tmp suffix, so no listing takes it for the real file
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp")


def resolve_output(path: str | Path) -> Path:
    """Where writing ``path`` actually writes: the path itself, or the file a symbolic link points to."""
    target = Path(path)
    return target.resolve(strict=False) if target.is_symlink() else target


def _is_special(path: Path) -> bool:
    """A device, a pipe or a socket: something to write into, never to replace."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def is_stdout(path: str | Path) -> bool:
    """True when writing ``path`` writes this process's standard output (``/dev/stdout``, ``/proc/self/fd/1``)."""
    try:
        mine, theirs = os.fstat(1), os.stat(path)
    except (OSError, ValueError):
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def check_output(path: str | Path, what: str) -> Path:
    """Check now that ``path`` can be written, so a run does not fail (or lose its results) at its end.

    Returns the path that will be written (a symbolic link's target). Creates no file; may create no directory
    either (the missing ones are checked against the first existing parent).

    Raises:
        ConfigError: naming ``what`` (e.g. ``--metrics-out``): the path is a directory, lies under a file or a
            directory this user may not search, or its directory cannot be written.
    """
    try:
        return _check_output(path, what)
    except OSError as err:  # a directory on the way this user may not search (no execute permission), say
        raise ConfigError(
            f"{what} {path}: {err.strerror or err}{f' ({err.filename})' if err.filename else ''}; this user "
            f"cannot reach that path: choose a path you can write to, or fix the permissions of its directories"
        ) from err


def _check_output(path: str | Path, what: str) -> Path:
    # a device or pipe behind links (/dev/stdout -> /proc/self/fd/1 -> pipe:[...]): written through the path given,
    # since the last link's target names no file
    if _is_special(Path(path)):
        if not os.access(path, os.W_OK):
            raise ConfigError(f"{what} {path}: it cannot be written; choose another path")
        return Path(path)
    target = resolve_output(path)
    if target.is_dir():
        raise ConfigError(f"{what} {path}: is a directory; give a file name inside it")
    parent = target.parent
    while not parent.exists():
        if parent.is_symlink():  # a dangling link on the way: creating "through" it would surprise
            raise ConfigError(f"{what} {path}: {parent} is a broken symbolic link; fix it or choose another path")
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {path}: {parent} is a file, so nothing can be created under it; choose a path")
    probe = parent / f".paratrain-probe.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        probe.unlink()
    except OSError as err:
        raise ConfigError(
            f"{what} {path}: cannot create files in {parent} ({err.strerror or err}); choose a writable path"
        ) from err
    return target


def check_input_dir(path: str | Path, what: str) -> Path:
    """Check now that the directory ``path``, if it exists, can be listed and read by this user.

    A directory that does not exist yet passes (a download may create it: :func:`check_output` checks that).

    Raises:
        ConfigError: naming ``what`` (e.g. ``--data-dir``): the path is a file, or this user may not search or
            read it.
    """
    directory = Path(path)
    try:
        if not directory.exists():
            return directory
        if not directory.is_dir():
            raise ConfigError(f"{what} {path}: is a file; give the directory that holds the files")
        os.listdir(directory)
    except OSError as err:
        raise ConfigError(
            f"{what} {path}: {err.strerror or err}; this user cannot read that directory: fix its permissions (and "
            f"those of the directories above it), or choose another"
        ) from err
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ConfigError(
            f"{what} {path}: this user cannot read that directory; fix its permissions, or choose another"
        )
    return directory


def scratch_directory() -> Path:
    """Where this process creates the files it needs only while it runs.

        fd, name = tempfile.mkstemp(prefix="paratrain-stacks-", dir=scratch_directory())

    The job's directory that paratrain's launcher made (``PARATRAIN_JOB_DIR``), when it is a directory of this
    user's that no one else may write; else the system's temporary directory (``TMPDIR``, ``/tmp``), which others
    share: create files there with :func:`tempfile.mkstemp` (an unpredictable name, created exclusively, mode 0600).
    """
    named = os.environ.get(JOB_DIR_ENV)
    if named and _is_private_directory(Path(named)):
        return Path(named)
    return Path(tempfile.gettempdir())


def _is_private_directory(path: Path) -> bool:
    """A directory itself (not a link to one), this user's, that neither its group nor others may write."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    owner = os.geteuid() if hasattr(os, "geteuid") else info.st_uid
    return stat.S_ISDIR(info.st_mode) and info.st_uid == owner and not info.st_mode & 0o022


@contextlib.contextmanager
def atomic_writer(
    path: str | Path, mode: str = "wb", *, durable: bool = False, follow_links: bool = True
) -> Iterator[IO[Any]]:
    """A file object whose contents replace ``path`` only once the block completes (see the module docstring).

    ``durable``: fsync the data and the directory entry, so the new file survives a power cut (checkpoints).
    ``follow_links``: False replaces a symbolic link at ``path`` by the file instead of writing what it points to.
    On an exception the temporary file is removed and ``path`` is left as it was.
    """
    planted = not follow_links and Path(path).is_symlink()
    if not planted and _is_special(Path(path)):  # followed through every link (/dev/stdout to a pipe): write into it
        with open(path, mode) as stream:
            yield stream
        return
    target = Path(path) if planted else resolve_output(path)
    if not planted and target.is_dir():  # a planted link to a directory is replaced like any other
        raise IsADirectoryError(21, "Is a directory", str(target))
    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{target.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    # O_EXCL: never write into someone else's file; 0o666 lets the umask decide the mode as for any file
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as stream:
            yield stream
            stream.flush()
            if durable:
                os.fsync(stream.fileno())
        os.replace(temporary, target)
        if durable:
            fsync_directory(directory)
    finally:
        # a no-op after the rename; after a failure (or Ctrl-C) it removes the partial file
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the temporary files in ``directory`` left by writers on this machine that no longer run.

    A writer killed mid-write (SIGKILL, a power cut) leaves its temporary file behind; one still running, or
    one on another machine sharing the directory, is left alone. Returns the deleted paths.
    """
    removed: list[Path] = []
    try:
        entries = list(Path(directory).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match is None or match["host"] != _HOST or _alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            entry.unlink()
            removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable (a no-op where the platform or file system cannot)."""
    # The rename is durable only once the directory entry is on disk; without this a power cut just after
    # os.replace can bring back the old file, or no file at all.
    if os.name != "posix":
        return  # Windows cannot open a directory for fsync; NTFS journals the rename itself
    # Some network and FUSE file systems refuse fsync on a directory. The file's data is already synced, so a
    # refusal costs only the power-cut guarantee for the rename, not worth failing a write that succeeded.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
