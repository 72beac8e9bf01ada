"""The thread that waits for gloo's sends and receives: each Work waited for once, in order, a future per batch.

Stand-in Works here (gloo's real ones are driven by the zero1/zero2 tests at two ranks, tests/test_zero.py): a
gloo send or receive must be waited for exactly once, so each stand-in counts its waits and blocks until let go.
"""

from __future__ import annotations

import threading

import pytest

from paratrain.comm.work_waiter import WorkWaiter


class _Work:
    def __init__(self, error: str | None = None) -> None:
        self.go = threading.Event()
        self.waits = 0
        self.error = error

    def wait(self) -> bool:
        self.waits += 1
        assert self.go.wait(30), "never let go"
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def test_each_batch_is_done_once_its_works_were_each_waited_for_once_in_order():
    waiter = WorkWaiter("test-waiter")
    first, second, third = _Work(), _Work(), _Work()
    a = waiter.after([first, second])
    b = waiter.after([third])
    third.go.set()  # done, but waited for only after the first batch
    assert not a.done() and not b.done()
    first.go.set()
    assert not a.done()
    second.go.set()
    a.wait()
    b.wait()
    assert (first.waits, second.waits, third.waits) == (1, 1, 1)


def test_a_failed_work_fails_its_batch_and_the_next_batch_still_completes():
    waiter = WorkWaiter("test-waiter")
    failed, skipped, later = _Work("Connection closed by peer"), _Work(), _Work()
    a = waiter.after([failed, skipped])
    b = waiter.after([later])
    failed.go.set()
    later.go.set()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        a.wait()
    b.wait()
    assert (failed.waits, skipped.waits, later.waits) == (1, 0, 1)  # the batch's rest is not waited for


def test_the_waiter_thread_is_a_daemon_started_by_the_first_batch():
    waiter = WorkWaiter("test-waiter-daemon")
    assert not [t for t in threading.enumerate() if t.name == "test-waiter-daemon"]
    work = _Work()
    done = waiter.after([work])
    (thread,) = [t for t in threading.enumerate() if t.name == "test-waiter-daemon"]
    assert thread.daemon  # a wait that never returns (a peer that died) does not keep the process alive
    work.go.set()
    done.wait()


def test_close_ends_the_thread_after_the_batches_given_and_a_later_batch_starts_another():
    waiter = WorkWaiter("test-waiter-close")
    work = _Work()
    done = waiter.after([work])
    (thread,) = [t for t in threading.enumerate() if t.name == "test-waiter-close"]
    waiter.close()
    assert thread.is_alive()  # still waiting for the batch given before
    work.go.set()
    thread.join(30)
    assert done.done() and not thread.is_alive()
    again = _Work()
    again.go.set()
    waiter.after([again]).wait()  # a new thread
