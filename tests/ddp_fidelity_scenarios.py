"""What each rank runs in the fidelity tests: our DistributedDataParallel beside torch's, on the same steps.

Most scenarios train the same model under both classes (the oracle) and report the largest difference in
gradients and parameters, and the spread of our parameters across ranks (0 when the replicas agree). Each
returns JSON-able findings; test_ddp_fidelity.py asserts on them. Here: the oracle helpers, and no_sync with
unused parameters, create_graph, pickling, frozen modules, static_graph; ddp_behaviour_scenarios.py: the
rest of torch's tests that want two GPUs, on the CPU.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paratrain.ddp.distributed import DistributedDataParallel as Ours
from paratrain.errors import DistributedError

TorchDDP = nn.parallel.DistributedDataParallel
Step = Callable[[nn.Module, int, int], torch.Tensor]  # (wrapped model, step, rank) -> loss


def spread(tensors: list[torch.Tensor]) -> float:
    """The largest difference of any of ``tensors`` between this rank and the others (0: equal everywhere)."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    everyone = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    return max((e - flat).abs().max().item() for e in everyone)


def grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def diff(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    """The largest difference between two lists of gradients; inf where only one of them is None."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            worst = max(worst, 0.0 if x is None and y is None else float("inf"))
        else:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def against_torch(
    make: Callable[[], nn.Module], step: Step, steps: int, rank: int, zero_grad: bool = True, **kwargs: Any
) -> dict[str, float]:
    """``steps`` SGD steps of ``make()`` under torch's class and ours with ``kwargs``; the largest differences."""
    torch.manual_seed(0)
    base = make()
    models = {"torch": TorchDDP(copy.deepcopy(base), **kwargs), "ours": Ours(copy.deepcopy(base), **kwargs)}
    worst = {"grads": 0.0, "params": 0.0}
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=0.1) for name, model in models.items()}
    for i in range(steps):
        found = {}
        for name, model in models.items():
            if zero_grad:
                optimizers[name].zero_grad()
            step(model, i, rank).backward()
            found[name] = grads(model)
            optimizers[name].step()
        worst["grads"] = max(worst["grads"], diff(found["torch"], found["ours"]))
    worst["params"] = diff(
        [p.detach() for p in models["torch"].parameters()], [p.detach() for p in models["ours"].parameters()]
    )
    worst["spread"] = spread(list(models["ours"].parameters()))
    worst["moved"] = diff([p.detach() for p in base.parameters()], [p.detach() for p in models["ours"].parameters()])
    return worst


# -- the five gaps ------------------------------------------------------------------------------------------------


class Conditional(nn.Module):
    """torch's test_grads_same_across_ranks_with_no_sync model: rank 0 uses a then b, rank 1 uses c then d."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.a, self.b, self.c, self.d = (nn.Linear(1, 1) for _ in range(4))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        first = self.calls % 2 == 1
        layer = (self.a if first else self.b) if self.rank == 0 else (self.c if first else self.d)
        return layer(x)


def no_sync_with_unused(rank: int, world: int) -> dict[str, Any]:
    """A parameter used only in a micro-batch under no_sync still counts as used in the synchronised backward."""
    found: dict[str, Any] = {}
    for name, cls in (("torch", TorchDDP), ("ours", Ours)):
        torch.manual_seed(0)
        model = cls(Conditional(rank), find_unused_parameters=True)
        x = torch.full((1, 1), float(rank + 1))
        with model.no_sync():
            model(x).sum().backward()
        model(x).sum().backward()
        found[name] = grads(model)
        found[f"{name}_none"] = [g is None for g in found[name]]
        found[f"{name}_spread"] = spread([g if g is not None else torch.full((1,), -1.0) for g in found[name]])
    return {
        "vs_torch": diff(found["torch"], found["ours"]),
        "ours_none": found["ours_none"],
        "ours_spread": found["ours_spread"],
        "torch_spread": found["torch_spread"],
    }


def create_graph(rank: int, world: int) -> dict[str, Any]:
    """backward(create_graph=True), as gradient penalties do: no error, gradients averaged and in a graph."""

    class Square(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.p = nn.Parameter(torch.tensor([1.5]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.p * x).pow(2).sum()

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        loss = model(torch.tensor([float(rank + 1 + i)]))
        loss.backward(create_graph=True)
        return torch.zeros((), requires_grad=True)  # against_torch's own backward: nothing more to add

    def penalty_step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        """A gradient penalty: torch.autograd.grad through the model first (no parameter gradient), then backward."""
        x = torch.tensor([float(rank + 1 + i)], requires_grad=True)
        out = model(x)
        (grad_x,) = torch.autograd.grad(out, x, create_graph=True)
        return out + grad_x.pow(2).sum()

    result: dict[str, Any] = against_torch(Square, step, 3, rank)
    result["penalty"] = against_torch(Square, penalty_step, 3, rank)
    model = Ours(Square())
    model(torch.tensor([float(rank + 1)])).backward(create_graph=True)
    result["grad_in_graph"] = bool(model.module.p.grad.requires_grad)
    return result


def pickling(rank: int, world: int) -> dict[str, Any]:
    """torch.save(ddp_model) and copy.deepcopy, then more training: the same as without the round trip."""

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * i + rank)
        return F.mse_loss(model(torch.randn(4, 3, generator=g)), torch.randn(4, 2, generator=g))

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    kept = Ours(copy.deepcopy(base), gradient_as_bucket_view=True)
    saved = Ours(copy.deepcopy(base), gradient_as_bucket_view=True)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(kept)
    for model in (kept, loaded, copied):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(3):
            optimizer.zero_grad()
            step(model, i, rank).backward()
            optimizer.step()
    params = {name: [p.detach() for p in m.parameters()] for name, m in (("kept", kept), ("loaded", loaded))}
    found: dict[str, Any] = {
        "loaded_vs_kept": diff(params["loaded"], params["kept"]),
        "copied_vs_kept": diff([p.detach() for p in copied.parameters()], params["kept"]),
        "loaded_spread": spread(list(loaded.parameters())),
        "moved": diff([p.detach() for p in base.parameters()], params["kept"]),
        "loaded_type": type(loaded).__name__,
    }
    subgroup = dist.new_group(list(range(world)))
    try:
        torch.save(Ours(nn.Linear(2, 2), process_group=subgroup), io.BytesIO())
        found["subgroup_error"] = None
    except DistributedError as exc:
        found["subgroup_error"] = str(exc)
    return found


def refuses_frozen_modules(rank: int, world: int) -> dict[str, Any]:
    found = {}
    frozen = nn.Linear(2, 2).requires_grad_(False)
    for name, module in (("empty", nn.Module()), ("frozen", frozen)):
        try:
            Ours(module)
            found[name] = None
        except RuntimeError as exc:  # torch raises RuntimeError; ours is a DistributedError, also one
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


class WithSpare(nn.Module):
    """A layer used in forward, one never used, and one used outside forward (by the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = nn.Linear(3, 3)
        self.spare = nn.Linear(3, 3)
        self.outside = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


class CheckpointedTwice(nn.Module):
    """One layer run twice under reentrant activation checkpointing: its gradient arrives in two backwards."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.layer, x, use_reentrant=True)
        return self.head(checkpoint(self.layer, torch.tanh(h), use_reentrant=True))


class LastCheckpointed(nn.Module):
    """The last layer under reentrant checkpointing: the first gradients arrive in a nested backward."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.head, torch.tanh(self.first(x)), use_reentrant=True)


def _checkpoint_step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * i + rank)
    return model(torch.randn(3, 4, generator=g).requires_grad_()).pow(2).mean()


def static_graph(rank: int, world: int) -> dict[str, Any]:
    """static_graph=True: unused parameters and one used outside forward, as torch's; and a graph that changes."""

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * i + rank)
        inner = model.module
        return (model(torch.randn(2, 3, generator=g)) * inner.outside).sum()

    found: dict[str, Any] = {
        "static": against_torch(WithSpare, step, 4, rank, static_graph=True),
        "reentrant_checkpoint": against_torch(CheckpointedTwice, _checkpoint_step, 3, rank, static_graph=True),
        "last_checkpointed": against_torch(LastCheckpointed, _checkpoint_step, 3, rank),
        "last_checkpointed_static": against_torch(LastCheckpointed, _checkpoint_step, 3, rank, static_graph=True),
    }
    model = Ours(WithSpare(), static_graph=True)
    x = torch.randn(2, 3)
    (model(x) * model.module.outside).sum().backward()  # learns: spare unused
    try:
        (model(x) + model.module.spare(x)).sum().backward()  # spare now used, outside not: not static
        found["changed_error"] = None
    except DistributedError as exc:
        found["changed_error"] = str(exc)
    return found


def outside_forward_without_static_graph(rank: int, world: int) -> str | None:
    """find_unused_parameters without static_graph: a parameter used outside forward is an error (as torch's)."""
    model = Ours(WithSpare(), find_unused_parameters=True)
    try:
        (model(torch.randn(2, 3)) * model.module.outside).sum().backward()
    except DistributedError as exc:
        return str(exc)
    return None
