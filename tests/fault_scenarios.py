"""What each rank runs in the fault tests that start no ``paratrain train`` (tests/test_faults.py)."""

from __future__ import annotations

import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import paratrain
from paratrain.errors import CheckpointError
from paratrain.training.interrupt import StopRequest

SHARDED = ("zero1", "zero2", "zero3")


def a_rank_that_cannot_write_its_slices(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Under each sharded strategy, the last rank's slices do not fit its file-size limit (EFBIG, as on a full
    disk) at one save: how long each rank's ``par.save`` took to fail, and what it said; the loop catches it and
    goes on, saves again without the limit and trains a step (so every rank is still at the same collective)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    return {s: _save_fails_on(s, rank == world - 1, Path(directory) / s) for s in SHARDED}


def _save_fails_on(strategy: str, limited: bool, root: Path) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    root.mkdir(parents=True, exist_ok=True)
    with paratrain.Parallel(strategy, "cpu", timeout=60) as par:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 8))  # a rank's slices: about 0.5 MB
        net, opt = par.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        x = torch.randn(4, 512)
        par.backward(net(x).square().mean())
        opt.step()
        if limited:  # the group's file store (in the working directory) grows too, by far less
            resource.setrlimit(resource.RLIMIT_FSIZE, (Path("store").stat().st_size + 100_000, hard))
        started = time.monotonic()
        error = None
        try:
            par.save({"model": net, "optimizer": opt, "step": 1}, root / "epoch-0000-step-000001.pt")
        except CheckpointError as exc:
            error = str(exc)
        took = time.monotonic() - started
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        par.save({"model": net, "optimizer": opt, "step": 1}, root / "epoch-0000-step-000002.pt")
        opt.zero_grad()
        par.backward(net(x).square().mean())  # the ranks' collectives still pair
        opt.step()
        return {"error": error, "seconds": took, "entries": sorted(os.listdir(root))}


def a_peers_proposal_then_this_ranks_own_ctrl_c(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 gets Ctrl-C and proposes a step; rank 1 learns it from the store first (its watcher), and only then
    gets its own SIGINT, as a rank does whose signal lands while it waits in a collective: that SIGINT is its first.
    Each rank's signals, and the step each stops after."""
    deadline = time.monotonic() + 30
    with paratrain.Parallel("ddp", "cpu", timeout=60) as par, StopRequest(par) as stop:
        started = time.perf_counter()
        if rank == 0:
            os.kill(os.getpid(), signal.SIGINT)
            while not stop.signalled and time.monotonic() < deadline:
                time.sleep(0.01)  # Python runs the handler at a bytecode boundary
            stop.due(5, started, 5)  # proposes 5 + the steps of half a second
        else:
            while stop.stop_after is None and time.monotonic() < deadline:
                time.sleep(0.01)  # the watcher's look at the store
            os.kill(os.getpid(), signal.SIGINT)  # before the fix: taken as the second Ctrl-C, os._exit(130)
            while stop.signals == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
        agreed = stop.stop_after
        assert agreed is not None
        stops = [n for n in range(5, agreed + 1) if stop.due(n, started, n)]  # every step up to the agreed one
        return {"signals": stop.signals, "proposed": stop.proposed, "agreed": agreed, "stops": stops}
