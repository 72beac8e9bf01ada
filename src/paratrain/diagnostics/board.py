"""The progress board: every rank's collectives, heartbeat and waiting time, kept in the process group's store.

A background thread per rank publishes one entry under one key, once a second: how many collectives the rank has
launched, a heartbeat, the collective it is waiting in (or the last it finished), how long it has waited in
collectives so far, and where it runs (host, pid). When a collective fails or times out, any rank can read the
board and tell apart a rank that never launched the collective (its count is behind) from one that is silent (its
heartbeat has stopped: stopped, hung in native code, or dead), and name them. The training step only sets numbers;
the store is written by the thread, once a second.

The same thread answers the job's questions: at every beat it runs the ``on_beat`` callback (the collective
watchdog, the hang report's request: see :mod:`paratrain.diagnostics.hang_report`).

    board = Board(store, "ddp0", rank=0, global_ranks=[0, 1, 2], status=monitor.status)
    board.post(17)                   # launched collective 17
    board.behind(17)                 # global ranks whose count is below 17
    board.silent()                   # global ranks whose heartbeat did not move for a while, and unreadable ones
    board.read()                     # every other rank's entry, by global rank
    board.close()
    claim_diagnosis(store, rank=0)   # True for the job's first rank to say what went wrong (its error is the one)
    diagnosed_by(store)              # that rank, for the others' errors to point to; None while no one has
    found_cause(store, rank=0)       # this rank found the mistake (a call its peers did not make) and leaves
    cause_found_by(store)            # that rank: a peer whose collective fails as it leaves says so in one line
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HEARTBEAT_S", "Board", "cause_found_by", "claim_diagnosis", "diagnosed_by", "found_cause"]

HEARTBEAT_S = 1.0  # the heartbeat's period; a rank silent for a few of these is not running
DIAGNOSIS_KEY = "paratrain/diagnosis"  # the job's one diagnosis: which rank gives it (every monitor, every meeting)
CAUSE_KEY = "paratrain/cause"  # the rank that found the job's mistake and leaves because of it
_HOST = socket.gethostname()


class Board:
    """One rank's publisher, and the reader of every rank's entry.

    Args:
        store: the process group's key-value store (``get``/``set``/``check``).
        namespace: the same on every rank of the group, unique among this rank's boards.
        rank: this rank's index in ``global_ranks``.
        global_ranks: the group's members, as global ranks (the keys use them, so boards of different groups
            never share a key).
        on_beat: called by the thread at every heartbeat (the collective watchdog runs there).
        status: what this rank publishes beside its count and heartbeat (a JSON-able dict), read every beat.
    """

    def __init__(
        self,
        store: Any,
        namespace: str,
        rank: int,
        global_ranks: list[int],
        on_beat: Callable[[], None] | None = None,
        interval: float = HEARTBEAT_S,
        status: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.store = store
        self.prefix = f"paratrain/{namespace}"
        self.rank = rank
        self.global_ranks = global_ranks
        self._on_beat = on_beat
        self._status = status
        self.interval = interval
        self._latest = 0
        self._beat = 0
        self._failed: int | None = None
        self._closed = False  # close() ran: this rank's wrapper (or strategy) is gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"paratrain-{namespace}-board", daemon=True)
        self._thread.start()

    @property
    def global_rank(self) -> int:
        return self.global_ranks[self.rank]

    def post(self, seq: int) -> None:
        """This rank launched collective ``seq``: published at the next heartbeat (the step never waits, nor wakes
        the thread: timeouts are seconds long, and a count a second old still names the right ranks)."""
        self._latest = seq

    def failed(self, seq: int) -> None:
        """This rank saw collective ``seq`` fail and is about to raise: published now, so that peers which look
        after it has left name it as a rank that failed too, not as one that stopped responding."""
        self._failed = seq
        self._publish()

    def close(self) -> None:
        """Stop publishing and join the thread, then publish once more that this rank closed; safe to call twice.

        Before the process group and its store go away, and before the interpreter finalizes: a thread that
        returns from ``store.set`` (which releases the GIL) while the interpreter finalizes is ended by
        ``pthread_exit`` inside pybind11's GIL guard, and that aborts the process.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
            if not self._thread.is_alive():  # the last entry says so: a peer waiting for this rank stops waiting
                self._closed = True
                self._publish()

    def key(self, global_rank: int, what: str = "entry") -> str:
        """The store key of ``what`` for ``global_rank`` under this board's namespace."""
        return f"{self.prefix}/{what}/{global_rank}"

    def entry(self) -> dict[str, Any]:
        """This rank's entry as the thread publishes it."""
        entry: dict[str, Any] = {
            "seq": self._latest,
            "beat": self._beat,
            "host": _HOST,
            "pid": os.getpid(),
            "time": time.time(),
        }
        if self._failed is not None:
            entry["failed"] = self._failed
        if self._closed:
            entry["closed"] = True
        if self._status is not None:
            entry.update(self._status())
        return entry

    def _run(self) -> None:
        if not self._publish():  # at once: a rank that stops in its first second is still on the board
            return
        while not self._stop.wait(self.interval):  # one heartbeat an interval; close() cuts the wait short
            self._beat += 1
            if self._on_beat is not None:
                self._on_beat()
            if not self._publish():
                return

    def _publish(self) -> bool:
        try:
            self.store.set(self.key(self.global_rank), json.dumps(self.entry()))
        except Exception:  # the store went away (shutdown, or its host died): nothing left to report to
            return False
        return True

    def read(self, *, everyone: bool = False) -> dict[int, dict[str, Any] | None]:
        """Every other rank's entry (``everyone``: this rank's too), by global rank; None where it cannot be read,
        and ``{"seq": 0, "beat": 0}`` for a rank that has not published yet."""
        entries: dict[int, dict[str, Any] | None] = {}
        for group_rank, rank in enumerate(self.global_ranks):
            if group_rank == self.rank and not everyone:
                continue
            key = self.key(rank)
            try:
                if not self.store.check([key]):
                    entries[rank] = {"seq": 0, "beat": 0}
                    continue
                entries[rank] = json.loads(self.store.get(key).decode())
            except Exception:
                entries[rank] = None
        return entries

    def read_one(self, global_rank: int) -> dict[str, Any] | None:
        """``global_rank``'s entry; None when it has not published yet or cannot be read."""
        try:
            key = self.key(global_rank)
            return json.loads(self.store.get(key).decode()) if self.store.check([key]) else None
        except Exception:
            return None

    def behind(self, seq: int) -> tuple[list[int], list[int]]:
        """Global ranks whose count is below ``seq`` (they never launched collective ``seq``), and those whose
        entry could not be read (the store is unreachable)."""
        entries = self.read()
        missing = [rank for rank, entry in entries.items() if entry is not None and entry["seq"] < seq]
        unknown = [rank for rank, entry in entries.items() if entry is None]
        return missing, unknown

    def silent(self, watch: float | None = None) -> tuple[list[int], list[int]]:
        """Global ranks whose heartbeat does not move over ``watch`` seconds (default: about three beats), and those
        whose entry could not be read. A rank that published that it saw a collective fail is not silent: it
        raised its own error (and may have exited since)."""
        before = self.read()
        time.sleep(3.2 * self.interval if watch is None else watch)
        after = self.read()
        unknown = [rank for rank, entry in after.items() if entry is None]
        silent = [
            rank
            for rank, entry in after.items()
            if entry is not None and "failed" not in entry and (before.get(rank) or {}).get("beat") == entry["beat"]
        ]
        return silent, unknown


def claim_diagnosis(store: Any, rank: int) -> bool:
    """True for the first rank of the job to claim the diagnosis (it prints the error that says what went wrong,
    with the hang report when there is one); False for every later claim, whose errors point to that rank's. True
    when the store cannot be reached: no one else can be told either."""
    try:
        first = bool(store.add(f"{DIAGNOSIS_KEY}/claims", 1) == 1)
        if first:
            store.set(DIAGNOSIS_KEY, str(rank))
    except Exception:
        return True
    return first


def diagnosed_by(store: Any) -> int | None:
    """The global rank that claimed the job's diagnosis (:func:`claim_diagnosis`); None when none has, or the store
    cannot be read."""
    return _rank_at(store, DIAGNOSIS_KEY)


def found_cause(store: Any, rank: int) -> None:
    """``rank`` found what went wrong (a call its peers did not make, ranks that ran different collectives) and
    leaves because of it: a peer whose collective then fails knows it failed for that reason, not a crash."""
    with contextlib.suppress(Exception):  # the store is gone: the peers' errors say less, this rank's says it all
        store.set(CAUSE_KEY, str(rank))


def cause_found_by(store: Any) -> int | None:
    """The global rank that found the job's mistake (:func:`found_cause`); None when none did, or the store cannot be
    read."""
    return _rank_at(store, CAUSE_KEY)


def _rank_at(store: Any, key: str) -> int | None:
    try:
        return int(store.get(key).decode()) if store.check([key]) else None
    except Exception:
        return None
