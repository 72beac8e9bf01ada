"""What paratrain does to torch's process groups and their ``Work`` handles, below the collective monitor.

Timeouts as seconds, waiting on a ``Work`` with the backend's own timeout, launching collectives whose ``Work``
holds no Python object (so a finished job's worker cannot abort at exit), keeping a group whose collective
failed alive to the end of the process, and the group's own collective count. :mod:`paratrain.comm.collectives`
builds the monitor on these; the reducer, the DDP set-up and the strategies use them directly.

A ``Work`` outlives its Python handle on gloo's worker thread (``pt_gloo_runloop``), which drops its own
reference a moment after it completed the collective. The Work holds the collective's tensors, and a tensor
made in Python keeps its Python object alive while C++ references it (torch's PyObject preservation): the
last C++ reference that goes decrefs that object, which takes the GIL. When the worker's reference is the
last one and the interpreter is finalizing by then, CPython ends the worker with ``pthread_exit``, whose
unwinding through the Work's ``noexcept`` destructor calls ``std::terminate`` ("terminate called without an
active exception", SIGABRT). That happens when the process exits within milliseconds of a collective: after
an error raised on its result (a user who catches paratrain's error and exits) or after one that failed. So
every Work an error is raised about is kept to the end of the process (:func:`keep_forever`): the worker's
reference is then never the last, and the operating system reclaims the Work with the process.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from paratrain.errors import DistributedError

__all__ = ["default_store", "group_sequence", "keep_forever", "no_python_in_work", "to_seconds", "wait_work"]


def to_seconds(timeout: float | timedelta | None) -> float | None:
    """A timeout as seconds (``None``: wait forever); rejects zero, negative and non-finite values."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < seconds < float("inf"):
        raise DistributedError(
            f"timeout must be a positive, finite number of seconds or a timedelta; found {timeout!r}"
        )
    return seconds


def wait_work(work: Any, timeout: float | None) -> bool:
    """Wait for a ``Work`` with the backend's own timeout; False when it timed out, other failures raise.

    A Work that timed out or failed is kept to the end of the process (see the module docstring): gloo's thread
    drops its reference when the collective ends, which may be while the interpreter finalizes.
    """
    try:
        work.wait() if timeout is None else work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        keep_forever(work)
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return False
        raise
    return True


_TLS_KEY = "context"  # torch's backward stashes contextvars.copy_context() in thread-local storage under this
_HAS_TLS_API = all(
    hasattr(torch._C, name)
    for name in ("_is_key_in_tls", "_get_obj_in_tls", "_remove_obj_from_tls", "_stash_obj_in_tls")
)


@contextlib.contextmanager
def no_python_in_work() -> Iterator[None]:
    """Launch collectives whose ``Work`` holds no Python object.

    A gloo ``Work`` copies the thread-local state when it is created; inside backward (where the reducer launches
    its buckets) that state holds the Python ``contextvars.Context`` torch stashed for the backward. Gloo's own
    thread usually drops the last reference to a finished Work, and freeing that Context takes the GIL: if the
    interpreter is finalizing by then, CPython ends the thread with ``pthread_exit``, whose unwinding through
    the Work's ``noexcept`` destructor calls ``std::terminate`` ("terminate called without an active
    exception"): a finished job's worker dies with SIGABRT. Hiding the stash while the collective is enqueued
    leaves nothing in the Work that needs the GIL. (torch's own DDP launches from C++ without the stash.)
    """
    if not (_HAS_TLS_API and torch._C._is_key_in_tls(_TLS_KEY)):
        yield
        return
    stashed = torch._C._get_obj_in_tls(_TLS_KEY)
    torch._C._remove_obj_from_tls(_TLS_KEY)
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls(_TLS_KEY, stashed)


def keep_forever(*objects: Any) -> None:
    """Never free ``objects``: a group that holds a collective that will not complete (see
    :mod:`paratrain.comm.collectives`), or the ``Work`` of a collective an error is raised about (see the module
    docstring).

    HACK: one reference more than anything will release (the C API's Py_IncRef), so a group's destructor,
    which would join gloo's threads blocked in the lost collective, never runs, and a Work's last reference is
    never gloo's; the operating system reclaims them with the process. tests/test_hangs.py checks that a job with
    a stalled rank still ends promptly (it fails if a torch upgrade brings a destructor that waits elsewhere);
    tests/test_distributed.py that ranks which catch the start-up error exit with the user's code.
    """
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def group_sequence(group: Any) -> int:
    """How many collectives ``group`` has run (torch counts them per group; equal on every rank at the same
    point of a correct program). 0 when the group does not count."""
    counter = getattr(group, "_get_sequence_number_for_group", None)
    try:
        return int(counter()) if counter is not None else 0
    except RuntimeError:
        return 0


def default_store() -> Any:
    """The default process group's store; None when it has none (timeouts still work, without rank names)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a process group without a store: timeouts still work, without rank names
        return None
