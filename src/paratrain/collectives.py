"""Collectives that time out with the names of the ranks that did not arrive.

A collective that one rank never joins blocks the others until the backend's timeout (30 minutes by default),
and then says nothing about who was missing. Here every rank publishes how many collectives it has launched
to the process group's key-value store, from a background thread so the training step never waits on it.
When a wait times out, the ranks whose count is behind are the ones that did not arrive, and the error names
them.

    monitor = CollectiveMonitor(group, timeout=60.0, namespace="ddp0")   # the same namespace on every rank
    seq = monitor.launched()
    work = dist.all_reduce(t, async_op=True)
    monitor.wait(work, seq, "gradient all-reduce of bucket 0")
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .errors import DistributedError

__all__ = ["DEFAULT_TIMEOUT_S", "CollectiveMonitor", "to_seconds", "wait_work"]

DEFAULT_TIMEOUT_S = 300.0  # how long a collective may wait for the other ranks, everywhere in paratrain
_PUBLISH_INTERVAL_S = 0.2


def to_seconds(timeout: float | timedelta | None) -> float | None:
    """A timeout as seconds (``None``: wait forever); rejects zero and negative values."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not seconds > 0:
        raise DistributedError(f"timeout must be positive seconds or a timedelta; found {timeout!r}")
    return seconds


def wait_work(work: Any, timeout: float | None) -> bool:
    """Wait for a ``Work`` with the backend's own timeout; False when it timed out, other failures raise."""
    try:
        work.wait() if timeout is None else work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            return False
        raise
    return True


def _default_store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a process group without a store: timeouts still work, without rank names
        return None


class _Board:
    """Publishes this rank's launch count to the store from a daemon thread; reads everyone's on demand.

    Keys carry global ranks, so boards of wrappers over different process groups never share a key.
    """

    def __init__(self, store: Any, namespace: str, rank: int, global_ranks: list[int]) -> None:
        self._store = store
        self._prefix = f"paratrain/{namespace}"
        self._rank = rank
        self._global_ranks = global_ranks
        self._latest = 0
        self._stopped = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._publish, name=f"paratrain-{namespace}-board", daemon=True)
        self._thread.start()

    def post(self, seq: int) -> None:
        self._latest = seq
        self._wake.set()

    def close(self) -> None:
        """Stop publishing (before the process group and its store go away)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _publish(self) -> None:
        written = -1
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                return
            latest = self._latest
            if latest != written:
                try:
                    self._store.set(f"{self._prefix}/{self._global_ranks[self._rank]}", str(latest))
                except Exception:  # the store went away (shutdown): nothing left to report to
                    return
                written = latest
            # at most a few writes a second: timeouts are seconds long, and the step must not pay for this
            time.sleep(_PUBLISH_INTERVAL_S)

    def behind(self, seq: int) -> tuple[list[int], list[int]]:
        """Global ranks whose published count is below ``seq`` (they never launched collective ``seq``), and
        those whose count could not be read (the store went away)."""
        missing, unknown = [], []
        for group_rank, rank in enumerate(self._global_ranks):
            if group_rank == self._rank:
                continue
            key = f"{self._prefix}/{rank}"
            try:
                count = int(self._store.get(key)) if self._store.check([key]) else 0
            except Exception:
                unknown.append(rank)
                continue
            if count < seq:
                missing.append(rank)
        return missing, unknown


class CollectiveMonitor:
    """Numbers a wrapper's collectives and waits for them with a timeout that names missing ranks.

    Every rank must launch the same collectives in the same order (they do: the callers are deterministic),
    so the n-th launch on one rank is the n-th on every other. ``namespace`` must be the same on every rank of
    ``group`` and differ from that of any other live monitor on this rank (DistributedDataParallel agrees on
    one at start-up). Ranks in errors are global ranks (torchrun's RANK).
    """

    def __init__(self, group: Any, timeout: float | timedelta | None, namespace: str) -> None:
        self.timeout = to_seconds(timeout)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self._seq = 0
        store = _default_store() if self.timeout is not None else None
        global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)]
        self._board = _Board(store, namespace, self.rank, global_ranks) if store is not None else None

    def close(self) -> None:
        """Stop the background publisher; call before destroying the process group."""
        if self._board is not None:
            self._board.close()
            self._board = None

    def launched(self) -> int:
        """Record that this rank launches its next collective; returns its number."""
        self._seq += 1
        if self._board is not None:
            self._board.post(self._seq)
        return self._seq

    def wait(self, handle: Any, seq: int, what: str) -> Any:
        """Wait for a ``Work`` (from ``async_op=True``) or a future; DistributedError after the timeout.

        A ``Work`` is waited on directly with the backend's own timeout (no Python runs on the backend's
        threads); a future (from a communication hook) through a completion callback. Returns the future's
        value, or None for a ``Work``.
        """
        if not isinstance(handle, dist.Work):  # a future (torch._C.Future, not always torch.futures.Future)
            if self.timeout is not None and not handle.done():
                done = threading.Event()
                handle.add_done_callback(lambda _: done.set())
                if not done.wait(self.timeout):
                    raise self.timeout_error(seq, what)
            return handle.wait()
        try:
            finished = wait_work(handle, self.timeout)
        except RuntimeError as exc:
            raise DistributedError(f"rank {self.global_rank}: {what} (collective #{seq}) failed: {exc}") from exc
        if not finished:
            raise self.timeout_error(seq, what)
        return None

    def timeout_error(self, seq: int, what: str) -> DistributedError:
        if self._board is None:
            who = "the process group has no store to tell which ranks are missing"
        else:
            missing, unknown = self._board.behind(seq)
            if missing:
                who = f"rank(s) {', '.join(map(str, missing))} did not arrive"
            elif not unknown:
                who = "every rank launched it, so one of them is stuck inside it (or the network is)"
            else:
                who = "the store is unreachable"
            if unknown:
                who += f" (rank(s) {', '.join(map(str, unknown))} could not be asked: the store is unreachable)"
        return DistributedError(
            f"rank {self.global_rank}: {what} (collective #{seq}) did not complete within {self.timeout:g}s: {who}. "
            f"Check those processes (stuck, crashed, or skipping a forward/backward the others ran); use "
            f"join() for uneven inputs; raise the limit with timeout=... (paratrain train --timeout)"
        )
