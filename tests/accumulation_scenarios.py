"""One training loop with precision, accumulation and clipping, written once for every strategy.

The tests run it in this process (``single``, ``dp`` over CPU replicas) and in ddp ranks (``ddp_modes``), and
compare every run with :func:`plain`, the same training written with torch alone on the whole global batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F

import paratrain
from ddp_scenarios import mlp

# global batches of uneven sizes: over 2 ranks 7 -> 4, 3 and 5 -> 3, 2; in 4 micro-batches each rank's share is
# cut again (3 -> 1, 1, 1, 0; 2 -> 1, 1, 0, 0: some micro-batches are empty on some ranks)
GLOBAL_BATCHES = (10, 7, 10, 5)
LR = 0.1


def data(seed: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)) for n in GLOBAL_BATCHES]


class _Counter:
    count = 0


@contextlib.contextmanager
def counting_all_reduce() -> Iterator[_Counter]:
    """Count calls of torch.distributed.all_reduce (what our reducer launches per gradient bucket) in the block."""
    counter = _Counter()
    original = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.count += 1
        return original(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield counter
    finally:
        dist.all_reduce = original


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def loop(par: paratrain.Parallel, *, steps: int, clip: float | None = None) -> dict[str, Any]:
    """SGD over :func:`data` through ``par``: each global batch in ``steps`` micro-batches, then clip and step."""
    model = par.prepare(mlp())
    optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=LR))
    loader = par.prepare(data())
    norms, calls, applied = [], [], []
    for batch in loader:
        with counting_all_reduce() as counter:
            for x, y in par.accumulate(model, batch, steps=steps):
                out = model(x)
                assert out.dtype == torch.float32  # mixed precisions hand back float32 outputs
                par.backward(F.cross_entropy(out, y))
        calls.append(counter.count)
        if clip is not None:
            norms.append(float(par.clip_grad_norm_(model, clip)))
        applied.append(par.step(optimizer))
        optimizer.zero_grad()
    reducer = getattr(model, "reducer", None)
    return {
        "params": flat(par.unwrap(model)),
        "norms": norms,
        "all_reduce_calls": calls,
        "buckets": len(reducer.buckets) if reducer is not None else 0,
        "applied": applied,
        "skipped_steps": par.precision.skipped_steps,
    }


def plain(*, clip: float | None = None) -> dict[str, Any]:
    """The oracle: torch alone, one device, each global batch's mean loss, torch's clipping."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    norms = []
    for x, y in data():
        F.cross_entropy(model(x), y).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        optimizer.step()
        optimizer.zero_grad()
    return {"params": flat(model), "norms": norms}


def ddp_modes(rank: int, world: int) -> dict[str, Any]:
    """The loop under ddp in every precision, and a loop that synchronises every micro-batch (for the count)."""
    found: dict[str, Any] = {}
    for name, precision, steps, clip in (
        ("fp32_k1", "32", 1, 0.5),
        ("fp32_k4", "32", 4, 0.5),
        ("bf16_k4", "bf16-mixed", 4, None),
        ("fp16_k4", "16-mixed", 4, 0.5),
    ):
        par = paratrain.Parallel("ddp", "cpu", precision=precision)
        found[name] = loop(par, steps=steps, clip=clip)
        par.close()
    # without no_sync every micro-batch's backward synchronises: the counter sees each round
    par = paratrain.Parallel("ddp", "cpu")
    model = par.prepare(mlp())
    (x, y), *_ = par.prepare(data())
    with counting_all_reduce() as counter:
        for _ in range(4):
            par.backward(F.cross_entropy(model(x), y))
    found["synchronising_every_micro_batch"] = counter.count
    par.close()
    return found
