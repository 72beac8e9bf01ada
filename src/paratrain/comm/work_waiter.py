"""gloo's sends and receives, waited for on a thread of their own: a future that says when they are done.

    waiter = WorkWaiter()
    done = waiter.after([dist.isend(mine, peer), dist.irecv(theirs, peer)])   # returns at once
    done.done()                                      # pollable: True once both finished
    monitor.wait(done, seq, what)                    # or wait for it, with the monitor's timeout

A gloo send or receive ``Work`` says it is complete only once it has been waited for (``is_completed()`` stays
False after its data arrived), and a second wait for it never returns. Code that wants to go on while they run,
and to learn when they are done without blocking (the weights in flight of :mod:`paratrain.sharded.in_flight`),
hands them to this thread instead, which waits for each exactly once, in the order given, and completes a
future per batch: with ``None``, or with the first error. The thread holds the GIL only between waits (a
``Work``'s wait releases it). It is a daemon: a wait that never returns (a peer that died) does not keep the
process alive, and the caller's own wait on the future has the timeout.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

import torch

from paratrain.comm.process_groups import keep_forever

__all__ = ["WorkWaiter"]


class WorkWaiter:
    """One thread that waits for batches of ``Work`` handles in order; :meth:`after` gives a batch's future."""

    def __init__(self, name: str = "paratrain-work-waiter") -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[list[Any], torch.futures.Future[None]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def after(self, works: Sequence[Any]) -> torch.futures.Future[None]:
        """A future completed once every one of ``works`` was waited for (each once, by this waiter's thread)."""
        future: torch.futures.Future[None] = torch.futures.Future()
        if self._thread is None:
            self._queue = queue.SimpleQueue()  # the thread's own: one closed earlier may still drain its own
            self._thread = threading.Thread(target=self._run, args=(self._queue,), name=self._name, daemon=True)
            self._thread.start()
        self._queue.put((list(works), future))
        return future

    def close(self) -> None:
        """End the thread once it has waited for every batch given so far (a later batch starts another)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread = None

    @staticmethod
    def _run(batches: queue.SimpleQueue[tuple[list[Any], torch.futures.Future[None]] | None]) -> None:
        while True:
            item = batches.get()
            if item is None:
                return
            works, future = item
            try:
                for work in works:
                    work.wait()
            except Exception as exc:  # the peer went away, or the backend's timeout: the caller's wait raises it
                keep_forever(*works)  # gloo may still hold the rest (see paratrain.comm.process_groups)
                future.set_exception(exc)  # type: ignore[arg-type]  # torch types it as a result
            else:
                future.set_result(None)
