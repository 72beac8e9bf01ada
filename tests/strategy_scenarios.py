"""What each rank runs in the strategy tests (tests/test_strategies.py); every function returns JSON-able findings."""

from __future__ import annotations

import time

import torch

import paratrain
from paratrain.errors import CollectiveError


def a_metric_all_reduce_only_some_ranks_make(rank: int, world: int) -> str:
    """Rank ``world - 1`` skips a metric all-reduce the others make: they fail naming it, within the timeout."""
    with paratrain.Parallel("ddp", timeout=2) as par:
        if rank == world - 1:
            time.sleep(6)  # long enough for the others to time out and read the board
            return "skipped"
        started = time.monotonic()
        try:
            par.all_reduce(torch.ones(4))
        except CollectiveError as exc:
            return f"{time.monotonic() - started:.1f}s: {exc}"
        return "completed"
