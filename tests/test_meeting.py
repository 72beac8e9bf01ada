"""Meetings in a real store (torch's HashStore), the ranks as threads: they meet, and leave no keys behind."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from paratrain.comm.meeting import Meeting
from paratrain.errors import CollectiveError, ConfigError


def _meet(store, rank: int, times: int, found: dict) -> None:
    meeting = Meeting(store, "test/meet", rank, timeout=60, gone=dict)
    found[rank] = [meeting.attend("eval", range(2), "an evaluation", refuse=str) for _ in range(times)]


def test_ranks_meet_many_times_and_the_store_keeps_only_the_last_two_meetings_keys():
    store = dist.HashStore()
    found: dict = {}
    threads = [threading.Thread(target=_meet, args=(store, r, 50, found)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert found[0] == [{1: "here"}] * 50 and found[1] == [{0: "here"}] * 50
    kept = [n for n in range(1, 51) for r in range(2) if store.check([f"test/meet/eval-{n}/{r}"])]
    assert set(kept) <= {49, 50}, kept  # at most the last two meetings' keys
    assert store.check(["test/meet/eval-50/0"])  # a rank behind could still be reading the last one


def test_a_refused_meeting_withdraws_its_key():
    store = dist.HashStore()
    meeting = Meeting(store, "test/meet", 0, timeout=60, gone=lambda: {1: "went on"})
    with pytest.raises(ConfigError, match="1"):
        meeting.attend("eval", range(2), "an evaluation", refuse=lambda gone: f"ranks {sorted(gone)} went on")
    assert not store.check(["test/meet/eval-1/0"])


def test_a_refusal_and_a_timeout_raise_the_callers_errors():
    """The strategy's collectives raise CollectiveError (with the hang report on a timeout), not ConfigError."""
    store = dist.HashStore()
    went_on = Meeting(store, "test/meet", 0, timeout=60, gone=lambda: {1: "went on"})
    with pytest.raises(CollectiveError, match=r"rank 1 went on"):
        went_on.attend(
            "collective", range(2), "par.barrier()", refuse=lambda gone: f"rank 1 {gone[1]}", error=CollectiveError
        )
    late = Meeting(store, "test/meet", 0, timeout=0.2, gone=dict)
    with pytest.raises(CollectiveError, match=r"missing \[1\]"):
        late.attend(
            "collective",
            range(2),
            "par.barrier()",
            refuse=str,
            overdue=lambda missing: CollectiveError(f"missing {missing}"),
        )
    assert not store.check(["test/meet/collective-1/0"])  # withdrawn both times
