"""The progress board, driven directly: a dict-backed store, one board per rank, no process group."""

from __future__ import annotations

import os
import threading
import time

import torch.distributed as dist

from paratrain.diagnostics.board import Board, cause_found_by, claim_diagnosis, diagnosed_by, found_cause


class DictStore:
    """The part of a c10d store the board uses: set, get and check, on a dict shared by every "rank"."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.broken = False

    def set(self, key: str, value: str | bytes) -> None:
        if self.broken:
            raise RuntimeError("store gone")
        with self.lock:
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        if self.broken:
            raise RuntimeError("store gone")
        with self.lock:
            return self.data[key]

    def check(self, keys: list[str]) -> bool:
        if self.broken:
            raise RuntimeError("store gone")
        with self.lock:
            return all(k in self.data for k in keys)


def _boards(store: DictStore, n: int, interval: float = 0.02) -> list[Board]:
    return [Board(store, "t", rank, list(range(n)), interval=interval) for rank in range(n)]


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_counts_published_by_the_thread_name_who_is_behind():
    store = DictStore()
    boards = _boards(store, 3)
    try:
        boards[0].post(5)
        boards[1].post(5)
        boards[2].post(3)
        _wait_for(lambda: boards[0].read()[2]["seq"] == 3 and boards[0].read()[1]["seq"] == 5)
        assert boards[0].behind(5) == ([2], [])
        assert boards[0].behind(3) == ([], [])
        assert set(boards[2].read()) == {0, 1}  # every other rank, never itself
    finally:
        for board in boards:
            board.close()


def test_a_rank_whose_heartbeat_stops_is_silent_and_a_live_one_is_not():
    store = DictStore()
    boards = _boards(store, 2)
    try:
        _wait_for(lambda: boards[0].read()[1]["beat"] > 0)
        assert boards[0].silent(watch=0.2) == ([], [])
        boards[1].close()  # its thread stops: no heartbeat from now on
        assert boards[0].silent(watch=0.2) == ([1], [])
    finally:
        for board in boards:
            board.close()


def test_a_rank_that_never_published_counts_zero_and_an_unreachable_store_is_unknown():
    store = DictStore()
    lonely = Board(store, "t", 0, [0, 7], interval=10)  # rank 7 never starts
    try:
        assert lonely.behind(1) == ([7], [])
        store.broken = True
        assert lonely.behind(1) == ([], [7])
        assert lonely.silent(watch=0.01) == ([], [7])
    finally:
        lonely.close()


def test_close_stops_the_thread_at_once_and_twice_is_fine():
    board = Board(DictStore(), "t", 0, [0, 1], interval=30)
    started = time.monotonic()
    board.close()
    board.close()
    assert time.monotonic() - started < 2
    assert not board._thread.is_alive()


def test_the_watch_callback_runs_on_every_beat():
    beats = []
    board = Board(DictStore(), "t", 0, [0], on_beat=lambda: beats.append(1), interval=0.01)
    try:
        _wait_for(lambda: len(beats) >= 3)
    finally:
        board.close()


def test_an_entry_says_where_the_rank_runs_and_what_its_monitor_reports():
    store = DictStore()
    board = Board(store, "t", 0, [0, 1], interval=0.02, status=lambda: {"in": [4, "barrier"], "waited": 1.5})
    other = Board(store, "t", 1, [0, 1], interval=30)
    try:
        _wait_for(lambda: other.read()[0]["beat"] > 0)
        entry = other.read()[0]
        assert entry["in"] == [4, "barrier"] and entry["waited"] == 1.5
        assert entry["pid"] == os.getpid() and entry["host"]
        assert set(board.read(everyone=True)) == {0, 1}
    finally:
        board.close()
        other.close()


def test_a_rank_that_saw_the_failure_and_left_is_not_named_as_silent():
    """The race CI met: two ranks see a peer's exit; the one that reports fast and exits must not be named by the
    slower one as a rank that stopped responding. Only the rank that never said anything is silent."""
    store = DictStore()
    boards = _boards(store, 3)
    try:
        _wait_for(lambda: all(e and e.get("pid") for e in boards[0].read().values()))
        boards[1].failed(7)
        boards[1].close()  # it raised and left: its heartbeat stops
        boards[2].close()  # it died without a word
        silent, unknown = boards[0].silent(watch=0.1)
        assert (silent, unknown) == ([2], [])
        assert boards[0].read()[1]["failed"] == 7
    finally:
        for board in boards:
            board.close()


def test_the_jobs_diagnosis_is_claimed_once_and_the_others_learn_who_gave_it():
    """One diagnosis a job: the first claim wins, later ones (any monitor, any meeting) read whose it is."""
    store = dist.HashStore()
    assert diagnosed_by(store) is None
    assert claim_diagnosis(store, rank=1)
    assert not claim_diagnosis(store, rank=0) and not claim_diagnosis(store, rank=1)
    assert diagnosed_by(store) == 1
    assert cause_found_by(store) is None  # a hang report is a diagnosis, not a mistake found: a peer's exit is a crash
    found_cause(store, rank=1)
    assert cause_found_by(store) == 1
    broken = DictStore()
    broken.broken = True
    assert claim_diagnosis(broken, rank=0) and diagnosed_by(broken) is None  # nobody else can be told either
