"""The equivalence matrix (issue 49): every sharded strategy against ddp, cell by cell, at two ranks over gloo.

A cell is a precision, a model, a bucket size and a habit; in it ddp, zero1, zero2 and zero3 each train the same
model on the same global batches (AdamW, four steps), rank 1 sleeping before every step (a peer that runs late),
and each returns what the user's script sees: the norms ``par.clip_grad_norm_`` returned, the loss of every step,
the EMA it kept of the weights (read between steps inside ``par.full_weights``) and the final weights. The tests
(tests/test_equivalence.py) compare each sharded strategy's with ddp's: bit for bit (two ranks: a sum of two is
the same in any order, and every strategy runs the same elementwise arithmetic on the same numbers).

    cells = pairwise_cover()        # every pair of factors meets at least once: make test
    cells = full_product()          # every combination: make slow
    results = run_cells(cells, rank, world)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from nanogpt_shaped import CONTEXT, VOCAB, NanoGPT
from paratrain.strategies.fully_sharded import Zero3Strategy

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PRECISIONS = ("32", "bf16-mixed", "16-mixed")
MODELS = ("mlp", "cnn", "block", "gpt")
BUCKETS = ("default", "per-parameter")  # zero3: its default units, or every block a unit (min_params=1)
HABITS = ("clip", "accumulate", "ema")
STEPS = 4
GLOBAL_BATCH = 8
LATE_S = 0.02  # rank 1's sleep before every step
TINY_BUCKET_MB = 1e-6  # every parameter a bucket of its own


@dataclass(frozen=True)
class Cell:
    precision: str
    model: str
    buckets: str
    habit: str

    @property
    def name(self) -> str:
        return f"{self.precision}/{self.model}/{self.buckets}/{self.habit}"


def full_product() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(PRECISIONS, MODELS, BUCKETS, HABITS)]


def pairwise_cover() -> list[Cell]:
    """Cells in which every pair of values of two factors meets at least once (greedy, deterministic)."""
    factors = (PRECISIONS, MODELS, BUCKETS, HABITS)
    wanted = {
        (i, a, j, b) for i, j in itertools.combinations(range(len(factors)), 2) for a in factors[i] for b in factors[j]
    }
    chosen: list[Cell] = []
    candidates = list(itertools.product(*factors))
    while wanted:
        best = max(candidates, key=lambda values: len(_pairs(values) & wanted))
        chosen.append(Cell(*best))
        wanted -= _pairs(best)
    return chosen


def _pairs(values: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
    return {(i, values[i], j, values[j]) for i, j in itertools.combinations(range(len(values)), 2)}


# -- the models and their data ---------------------------------------------------------------------------------


class Block(nn.Module):
    """The issue's transformer block: ``nn.MultiheadAttention`` reads ``out_proj.weight`` without calling it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(self.inp(x)))  # type: ignore[no-any-return]


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(8, 4),
        )
    if name == "block":
        return Block()
    if name == "gpt":
        return NanoGPT()
    raise ValueError(name)


def batches(name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    n = GLOBAL_BATCH
    made = []
    for _ in range(STEPS):
        if name == "mlp":
            made.append((torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)))
        elif name == "cnn":
            made.append((torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 4, (n,), generator=g)))
        elif name == "block":
            made.append((torch.randn(n, 6, 16, generator=g), torch.randint(0, 4, (n, 6), generator=g)))
        else:
            tokens = torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=g)
            made.append((tokens[:, :-1], tokens[:, 1:]))
    return made


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


# -- one run ---------------------------------------------------------------------------------------------------


def parallel(strategy: str, cell: Cell) -> paratrain.Parallel:
    if strategy == "zero3":
        min_params = 1 if cell.buckets == "per-parameter" else 1024
        return paratrain.Parallel(Zero3Strategy("cpu", min_params=min_params, timeout=120), precision=cell.precision)
    bucket = {"bucket_cap_mb": TINY_BUCKET_MB} if cell.buckets == "per-parameter" else {}
    return paratrain.Parallel(strategy, "cpu", timeout=120, precision=cell.precision, **bucket)


def train(strategy: str, cell: Cell, rank: int) -> dict[str, Any]:
    """One script, written once for every strategy: what it returns is what its user sees."""
    norms: list[float] = []
    losses: list[float] = []
    ema: list[torch.Tensor] = []
    with parallel(strategy, cell) as par:
        net = build(cell.model)
        model, optimizer, loader = par.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), batches(cell.model))
        for x, y in loader:
            if cell.habit == "accumulate":
                total = 0.0
                for piece_x, piece_y in par.accumulate(model, (x, y), 2):
                    loss = loss_of(model(piece_x), piece_y)
                    par.backward(loss)
                    total += float(loss)
                losses.append(total)
            else:
                loss = loss_of(model(x), y)
                par.backward(loss)
                losses.append(float(loss))
            if cell.habit == "clip":
                norms.append(float(par.clip_grad_norm_(model, 0.05)))
            if rank == 1:
                time.sleep(LATE_S)  # a peer that runs late: the others' step waits for it
            par.step(optimizer)
            optimizer.zero_grad()
            if cell.habit == "ema":
                with par.full_weights(model) as weights:
                    current = [p.detach().clone() for p in weights.parameters()]
                if not ema:
                    ema = current
                else:
                    for e, w in zip(ema, current, strict=True):
                        e.mul_(0.9).add_(w, alpha=0.1)
        with par.full_weights(model) as weights:
            final = torch.cat([p.detach().reshape(-1).clone() for p in weights.parameters()])
            buffers = [b.detach().clone() for b in weights.buffers()]
    return {
        "norms": norms,
        "losses": losses,
        "ema": torch.cat([e.reshape(-1) for e in ema]) if ema else None,
        "weights": final,
        "buffers": buffers,
        "skipped": par.precision.skipped_steps,
    }


def compare(found: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """How far ``found`` is from ``reference``: the largest absolute difference of each, and whether all are equal."""

    def gap(a: Any, b: Any) -> float:
        if a is None or b is None:
            return 0.0 if a is b else float("inf")
        if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            return max((gap(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
        a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
        if a.shape != b.shape:
            return float("inf")
        if a.numel() == 0:
            return 0.0
        return float((a - b).abs().nan_to_num(nan=float("inf")).max())

    gaps = {key: gap(found[key], reference[key]) for key in ("norms", "losses", "ema", "weights", "buffers")}
    return {
        "gaps": gaps,
        "bitwise": all(g == 0.0 for g in gaps.values()) and found["skipped"] == reference["skipped"],
        "skipped": (found["skipped"], reference["skipped"]),
        "moved": float((reference["weights"] - _initial(reference)).abs().max()) if reference else 0.0,
    }


def _initial(reference: dict[str, Any]) -> torch.Tensor:
    return reference["initial"]  # type: ignore[no-any-return]


def run_cells(rank: int, world: int, cells: Iterable[Cell], strategies: Iterable[str] = STRATEGIES) -> dict[str, Any]:
    """Every cell under ddp and the sharded strategies, in this rank: each strategy's comparison with ddp."""
    results: dict[str, Any] = {}
    for cell in cells:
        reference = train("ddp", cell, rank)
        reference["initial"] = torch.cat([p.detach().reshape(-1) for p in build(cell.model).parameters()])
        row: dict[str, Any] = {}
        for strategy in strategies:
            if strategy == "ddp":
                continue
            try:
                row[strategy] = compare(train(strategy, cell, rank), reference)
            except paratrain.ConfigError as exc:
                row[strategy] = {"refused": f"{type(exc).__name__}: {exc}"}
        results[cell.name] = row
    return results


Scenario = Callable[[int, int], dict[str, Any]]


def pairwise(rank: int, world: int) -> dict[str, Any]:
    return run_cells(rank, world, pairwise_cover())


def product(rank: int, world: int) -> dict[str, Any]:
    return run_cells(rank, world, full_product())
