"""What each rank runs in the fidelity tests: our DistributedDataParallel beside torch's, on the same steps.

Most scenarios train the same model under both classes (the oracle) and report the largest difference in
gradients and parameters, and the spread of our parameters across ranks (0 when the replicas agree). Each
returns JSON-able findings; test_ddp_fidelity.py asserts on them. Written for torch's behavioural DDP tests
that want two GPUs (distributed_test.py), run here on the CPU with gloo.
"""

from __future__ import annotations

import copy
import io
import warnings
from collections import namedtuple
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paratrain.distributed import DistributedDataParallel as Ours
from paratrain.errors import ConfigError, DistributedError

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


# -- torch's behavioural tests that want GPUs, on the CPU ------------------------------------------------------------


class Branching(nn.Module):
    """Control flow: which layers run depends on the step and, with ``by_rank``, on the rank."""

    def __init__(self, by_rank: bool) -> None:
        super().__init__()
        self.by_rank = by_rank
        self.first = nn.Linear(4, 4)
        self.left = nn.Linear(4, 4)
        self.right = nn.Linear(4, 4)
        self.rank = dist.get_rank()

    def forward(self, x: torch.Tensor, i: int) -> torch.Tensor:
        h = F.relu(self.first(x))
        choice = i + (self.rank if self.by_rank else 0)
        if choice % 3 == 0:
            return self.left(h)
        if choice % 3 == 1:
            return self.right(h)
        return h  # neither branch: both layers unused this step


def _branch_step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * i + rank)
    return model(torch.randn(3, 4, generator=g), i).pow(2).mean()


def control_flow(rank: int, world: int) -> dict[str, Any]:
    return {
        "same": against_torch(lambda: Branching(False), _branch_step, 6, rank, find_unused_parameters=True),
        "different": against_torch(lambda: Branching(True), _branch_step, 6, rank, find_unused_parameters=True),
    }


class SharedAccumulator(nn.Module):
    """torch's test_ddp_shared_grad_acc_unused_params: a parameter reached through expand_as (which shares its
    gradient accumulator across uses), beside one that is never used."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.unused = nn.Parameter(torch.ones(1))
        self.net = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x) * self.scale.expand_as(x) + self.scale.expand_as(x)


Pair = namedtuple("Pair", ["left", "right"])


class Nested(nn.Module):
    """Outputs nested in a namedtuple, a dict and a list, one of them without a gradient, one made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        made_here = torch.tensor([1.0, 2.0])  # a new tensor, no gradient
        return Pair(self.a(x), {"b": [self.b(x)], "constant": made_here, "detached": self.a(x).detach()})


def _nested_step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * i + rank)
    out = model(torch.randn(3, 4, generator=g))
    return out.left.sum() + out.right["b"][0].pow(2).sum() + out.right["constant"].sum()


def _shared_step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * i + rank)
    return model(torch.randn(2, 4, generator=g)).sum()


def outputs_and_graphs(rank: int, world: int) -> dict[str, Any]:
    return {
        "shared_accumulator": against_torch(SharedAccumulator, _shared_step, 3, rank, find_unused_parameters=True),
        "nested_find_unused": against_torch(Nested, _nested_step, 3, rank, find_unused_parameters=True),
        "nested_static": against_torch(Nested, _nested_step, 3, rank, static_graph=True),
    }


def inference_and_buffers(rank: int, world: int) -> dict[str, Any]:
    """Forward under no_grad between training steps; BatchNorm buffers under each buffer setting, against torch."""

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * i + rank)
        x = torch.randn(6, 4, generator=g) * (rank + 1)
        with torch.no_grad():
            model(x)  # inference mid-step: it must not disturb the next backward
        return model(x).pow(2).mean()

    found: dict[str, Any] = {}
    for name, kwargs in (("default", {}), ("forward_sync_off", {"forward_sync_buffers": False})):
        found[name] = against_torch(make, step, 3, rank, **kwargs)
        buffers = {}
        for key, cls in (("torch", TorchDDP), ("ours", Ours)):
            torch.manual_seed(0)
            model = cls(make(), **kwargs)
            for i in range(3):
                step(model, i, rank).backward()
            buffers[key] = [b.detach().clone() for b in model.module.buffers()]
        found[name]["buffers_vs_torch"] = diff(buffers["torch"], buffers["ours"])
    return found


def start_up_states(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's parameters and buffers everywhere at start-up, under each setting that governs it."""
    found = {}
    settings: dict[str, dict[str, Any]] = {
        "default": {},
        "init_sync_off": {"init_sync": False},
        "broadcast_buffers_off": {"broadcast_buffers": False},
        "forward_sync_off": {"forward_sync_buffers": False},
    }
    for name, kwargs in settings.items():
        torch.manual_seed(rank)  # different on every rank before wrapping
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
        model[1].running_mean.fill_(float(rank))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated in newer torch
            Ours(model, **kwargs)
        found[name] = {"params": spread(list(model.parameters())), "buffers": spread([model[1].running_mean])}
    return found


class Skipping(nn.Module):
    """With ``skip``, every third step leaves the middle layer out: unused parameters under join."""

    def __init__(self, skip: bool) -> None:
        super().__init__()
        self.skip = skip
        self.first, self.middle, self.last = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.bn = nn.BatchNorm1d(4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.bn(self.first(x))
        return self.last(h if self.skip and self.calls % 3 == 0 else torch.tanh(self.middle(h)))


def join_options(rank: int, world: int) -> dict[str, Any]:
    """Uneven inputs (rank r has 2 + 2r batches, of 2 micro-batches with `accumulate`) under each join option,
    against torch's DDP."""

    def run(cls: type, accumulate: bool = False, ddp: dict[str, Any] | None = None, **join: Any) -> tuple[list, int]:
        torch.manual_seed(0)
        ddp = ddp or {}
        model = cls(Skipping(skip=ddp.get("find_unused_parameters", False)), **ddp)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        done = 0
        with model.join(**join):
            for i in range(2 + 2 * rank):
                g = torch.Generator().manual_seed(10 * i + rank)
                optimizer.zero_grad()
                if accumulate:
                    with model.no_sync():
                        model(torch.randn(4, 4, generator=g)).pow(2).mean().backward()
                model(torch.randn(4, 4, generator=g)).pow(2).mean().backward()
                optimizer.step()
                done += 1
        return [t.detach().clone() for t in model.module.state_dict().values()], done

    found: dict[str, Any] = {}
    options: dict[str, dict[str, Any]] = {
        "default": {},
        "divide_by_active": {"divide_by_initial_world_size": False},
        "find_unused": {"ddp": {"find_unused_parameters": True}},
        "no_sync": {"accumulate": True, "ddp": {"find_unused_parameters": True}},
    }
    for name, kwargs in options.items():
        theirs, _ = run(TorchDDP, **kwargs)
        ours, done = run(Ours, **kwargs)
        found[name] = {"vs_torch": diff(theirs, ours), "spread": spread([t.float() for t in ours]), "done": done}
    try:
        run(Ours, throw_on_early_termination=True)
        found["throw"] = None
    except DistributedError as exc:
        found["throw"] = str(exc)
    model = Ours(nn.Linear(2, 1))
    with model.join(enable=False):
        model(torch.ones(1, 2)).sum().backward()  # even inputs: enable=False runs no join collective
    found["disabled"] = model._join is None
    return found


def comm_hooks(rank: int, world: int) -> dict[str, Any]:
    """torch's own hooks, and one returning a chained future, against torch's DDP with the same hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def chained(state, bucket):  # unannotated: torch's register_comm_hook checks annotations
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()  # type: ignore[union-attr]
        return fut.then(lambda f: f.value()[0] / dist.get_world_size())

    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * i + rank)
        return F.mse_loss(model(torch.randn(4, 5, generator=g)), torch.randn(4, 2, generator=g))

    found: dict[str, Any] = {}
    for name, hook in (("allreduce", default_hooks.allreduce_hook), ("chained", chained)):
        torch.manual_seed(0)
        base = make()
        models = {"torch": TorchDDP(copy.deepcopy(base)), "ours": Ours(copy.deepcopy(base))}
        for model in models.values():
            model.register_comm_hook(None, hook)
            for i in range(3):
                step(model, i, rank).backward()
        found[name] = diff(grads(models["torch"]), grads(models["ours"]))
    try:
        models["ours"].register_comm_hook(None, chained)
        found["twice"] = None
    except ConfigError as exc:
        found["twice"] = str(exc)
    return found


def ignored_parameters(rank: int, world: int) -> dict[str, Any]:
    """torch's test_ddp_ignore_params_arg: parameters and buffers the module asks DDP to leave alone stay local."""

    def make() -> nn.Module:
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3), nn.Linear(3, 1))
        Ours._set_params_and_buffers_to_ignore_for_model(model, ["0.weight", "1.running_mean"])
        return model

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * i + rank)
        return model(torch.randn(4, 3, generator=g)).pow(2).mean()

    found: dict[str, Any] = against_torch(make, step, 3, rank)
    model = Ours(make())
    step(model, 0, rank).backward()
    inner = model.module
    found["ignored_spread"] = spread([inner[0].weight.grad, inner[1].running_mean])
    found["kept_spread"] = spread([inner[0].bias.grad, inner[2].weight.grad])
    return found


def surface(rank: int, world: int) -> dict[str, Any]:
    """The arguments refused by name, the ones accepted, a one-dimensional device mesh, a subgroup."""
    found: dict[str, Any] = {}
    layer = nn.Linear(2, 2)
    refused: dict[str, Any] = {
        "delay_all_reduce_named_params": [("weight", layer.weight)],
        "mixed_precision": object(),
        "bucket_cap_mb_list": [1, 2],
    }
    for name, value in refused.items():
        try:
            Ours(nn.Linear(2, 2), **{name: value})
            found[name] = None
        except ConfigError as exc:
            found[name] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Ours(nn.Linear(2, 2), check_reduction=True, batched_grad_copy=True, skip_all_reduce_unused_params=True)
    found["check_reduction_warns"] = any(issubclass(w.category, FutureWarning) for w in caught)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    def step(model: nn.Module, i: int, rank: int) -> torch.Tensor:
        return model(torch.full((1, 2), float(rank + i))).sum()

    found["device_mesh"] = against_torch(lambda: nn.Linear(2, 2), step, 2, rank, device_mesh=mesh)
    found["subgroup"] = against_torch(lambda: nn.Linear(2, 2), step, 2, rank, process_group=dist.new_group([0, 1]))
    from torch.distributed.algorithms.join import Join

    try:
        Join([Ours(nn.Linear(2, 2))])
        found["torch_join"] = None
    except ConfigError as exc:
        found["torch_join"] = str(exc)
    solo = dist.new_group([0])
    if rank == 0:  # a group of one: the gradient is this rank's own
        model = Ours(nn.Linear(2, 2), process_group=solo)
        step(model, 0, rank).backward()
        found["solo_group"] = model.world_size == 1 and model.module.weight.grad is not None
    else:
        try:
            Ours(nn.Linear(2, 2), process_group=solo)
            found["non_member"] = None
        except ConfigError as exc:
            found["non_member"] = str(exc)
    return found
