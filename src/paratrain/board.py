"""The progress board: every rank's collective count and heartbeat, kept in the process group's store.

A background thread per rank publishes two numbers under one key, once a second: how many collectives the rank
has launched, and a heartbeat. When a collective fails or times out, any rank can
read the board and tell apart a rank that never launched the collective (its count is behind) from one that is
silent (its heartbeat has stopped: stopped, hung in native code, or dead), and name them. The training step only
sets a number; the store is written by the thread, once a second.

    board = Board(store, "ddp0", rank=0, global_ranks=[0, 1, 2])
    board.post(17)                   # launched collective 17
    board.behind(17)                 # global ranks whose count is below 17
    board.silent()                   # global ranks whose heartbeat did not move for a while, and unreadable ones
    board.close()
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HEARTBEAT_S", "Board"]

HEARTBEAT_S = 1.0  # the heartbeat's period; a rank silent for a few of these is not running


class Board:
    """One rank's publisher, and the reader of every rank's entry.

    Args:
        store: the process group's key-value store (``get``/``set``/``check``).
        namespace: the same on every rank of the group, unique among this rank's boards.
        rank: this rank's index in ``global_ranks``.
        global_ranks: the group's members, as global ranks (the keys use them, so boards of different groups
            never share a key).
        on_beat: called by the thread at every heartbeat (the collective watchdog runs there).
    """

    def __init__(
        self,
        store: Any,
        namespace: str,
        rank: int,
        global_ranks: list[int],
        on_beat: Callable[[], None] | None = None,
        interval: float = HEARTBEAT_S,
    ) -> None:
        self._store = store
        self._prefix = f"paratrain/{namespace}"
        self._rank = rank
        self._global_ranks = global_ranks
        self._on_beat = on_beat
        self._interval = interval
        self._latest = 0
        self._beat = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paratrain-{namespace}-board", daemon=True)
        self._thread.start()

    def post(self, seq: int) -> None:
        """This rank launched collective ``seq``: published at the next heartbeat (the step never waits, nor wakes
        the thread: timeouts are seconds long, and a count a second old still names the right ranks)."""
        self._latest = seq

    def close(self) -> None:
        """Stop publishing and join the thread; safe to call twice.

        Before the process group and its store go away, and before the interpreter finalizes: a thread that
        returns from ``store.set`` (which releases the GIL) while the interpreter finalizes is ended by
        ``pthread_exit`` inside pybind11's GIL guard, and that aborts the process.
        """
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _key(self, group_rank: int) -> str:
        return f"{self._prefix}/{self._global_ranks[group_rank]}"

    def _run(self) -> None:
        while not self._stop.wait(self._interval):  # one heartbeat an interval; close() cuts the wait short
            self._beat += 1
            if self._on_beat is not None:
                self._on_beat()
            try:
                self._store.set(self._key(self._rank), f"{self._latest} {self._beat}")
            except Exception:  # the store went away (shutdown, or its host died): nothing left to report to
                return

    def read(self) -> dict[int, tuple[int, int] | None]:
        """Every other rank's (count, heartbeat), by global rank; None where it cannot be read."""
        entries: dict[int, tuple[int, int] | None] = {}
        for group_rank, rank in enumerate(self._global_ranks):
            if group_rank == self._rank:
                continue
            key = self._key(group_rank)
            try:
                if not self._store.check([key]):
                    entries[rank] = (0, 0)  # has not published yet
                    continue
                count, beat = self._store.get(key).decode().split()
                entries[rank] = (int(count), int(beat))
            except Exception:
                entries[rank] = None
        return entries

    def behind(self, seq: int) -> tuple[list[int], list[int]]:
        """Global ranks whose count is below ``seq`` (they never launched collective ``seq``), and those whose
        entry could not be read (the store is unreachable)."""
        entries = self.read()
        missing = [rank for rank, entry in entries.items() if entry is not None and entry[0] < seq]
        unknown = [rank for rank, entry in entries.items() if entry is None]
        return missing, unknown

    def silent(self, watch: float | None = None) -> tuple[list[int], list[int]]:
        """Global ranks whose heartbeat does not move over ``watch`` seconds (default: about three beats), and those
        whose entry could not be read."""
        before = self.read()
        time.sleep(3.2 * self._interval if watch is None else watch)
        after = self.read()
        unknown = [rank for rank, entry in after.items() if entry is None]
        return [rank for rank, entry in after.items() if entry is not None and entry == before.get(rank)], unknown
