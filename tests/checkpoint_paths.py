"""One path, one checkpoint (issue 50): a save under any strategy over an older checkpoint of the other form, then
a load under any strategy, at two ranks over gloo.

For every ordered pair (A, B) of strategies: the path first holds an older checkpoint in the form A does not write
(a file, or a sharded directory); a run under A trains two steps (AdamW, a LambdaLR schedule, 16-mixed's gradient
scaler) and saves its whole state at that exact path; a run under B loads it into fresh objects, in place, and
trains two steps more. What the tests compare: the path holds A's form, the schedule and the scale are A's after its
two steps exactly, and the weights after four steps are those of an uninterrupted run under B (bit for bit between
ddp and the zero stages at two ranks; within float32 summation order against one device).

``single`` runs on rank 0 only (rank 1 waits at a barrier): one device, the same global batches.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain

STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3")
FILE_FORM = ("single", "ddp")
STEPS = 4
GLOBAL_BATCH = 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randint(0, 4, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _parallel(strategy: str) -> paratrain.Parallel:
    timeout = {} if strategy == "single" else {"timeout": 120}
    return paratrain.Parallel(strategy, "cpu", precision="16-mixed", **timeout)


class _Run:
    """A training script's objects, prepared under one strategy."""

    def __init__(self, par: paratrain.Parallel) -> None:
        self.par = par
        net = _model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        self.model, self.optimizer, self.loader = par.prepare(net, optimizer, _data())
        self.state: dict[str, Any] = {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "precision": par.precision,
            "step": 0,
        }

    def train(self, steps: range) -> None:
        for i, (x, y) in enumerate(self.loader):
            if i in steps:
                self.par.backward(F.cross_entropy(self.model(x), y))
                self.par.step(self.optimizer)
                self.optimizer.zero_grad()
                self.scheduler.step()
                self.state["step"] = i + 1

    def weights(self) -> torch.Tensor:
        with self.par.full_weights(self.model) as module:
            return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])

    def schedule(self) -> dict[str, Any]:
        return {"lr": self.scheduler.get_last_lr(), "scale": self.par.precision.scaler.get_scale()}


def _on_ranks(strategy: str, rank: int, work: Any) -> Any:
    """``work(par)`` under ``strategy``: on every rank, or (single) on rank 0 while rank 1 waits."""
    result = None
    if strategy != "single" or rank == 0:
        with _parallel(strategy) as par:
            result = work(par)
    if strategy == "single":
        dist.barrier()
    return result


def _older(path: Path, strategy: str, rank: int) -> None:
    """An older checkpoint at ``path`` in the form ``strategy`` does not write (its step: -1)."""
    other = "zero2" if strategy in FILE_FORM else "ddp"

    def save(par: paratrain.Parallel) -> None:
        run = _Run(par)
        run.state["step"] = -1
        par.save(run.state, path)

    _on_ranks(other, rank, save)


def _uninterrupted(par: paratrain.Parallel) -> list[float]:
    run = _Run(par)
    run.train(range(STEPS))
    return run.weights().tolist()  # type: ignore[no-any-return]


def _save_half(path: Path, par: paratrain.Parallel) -> dict[str, Any]:
    run = _Run(par)
    run.train(range(STEPS // 2))
    par.save(run.state, path)
    return run.schedule()


def _load_and_finish(path: Path, par: paratrain.Parallel) -> dict[str, Any]:
    run = _Run(par)
    rest = par.load(path, run.state)  # objects restored in place, the plain "step" set in the state
    loaded = {"schedule": run.schedule(), "step": run.state["step"], "rest": sorted(rest)}
    run.train(range(run.state["step"], STEPS))
    loaded["weights"] = run.weights().tolist()
    return loaded


def pairs(rank: int, world: int, directory: str) -> dict[str, Any]:
    Path(directory).mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    reference = {strategy: _on_ranks(strategy, rank, _uninterrupted) for strategy in STRATEGIES}
    for first, then in itertools.permutations(STRATEGIES, 2):
        path = Path(directory) / f"{first}-then-{then}.pt"
        _older(path, first, rank)
        older_form = "dir" if path.is_dir() else "file"
        saved = _on_ranks(first, rank, functools.partial(_save_half, path))
        form = "dir" if path.is_dir() else "file"
        loaded = _on_ranks(then, rank, functools.partial(_load_and_finish, path))
        if loaded is not None:
            ref = torch.tensor(reference[then])
            weights = torch.tensor(loaded.pop("weights"))
            found[f"{first}->{then}"] = {
                "older_form": older_form,
                "form": form,
                "saved": saved,
                **loaded,
                "bitwise": torch.equal(weights, ref),
                "max_diff": float((weights - ref).abs().max()),
                "leftovers": sorted(p.name for p in Path(directory).iterdir() if p.name.startswith(".")),
            }
        dist.barrier()
    return found
