"""torch's behavioural DDP tests that want two GPUs (distributed_test.py), as each rank runs them on the CPU.

Each scenario trains under torch's class and ours (ddp_fidelity_scenarios.against_torch) or checks one part of
torch's surface, and returns JSON-able findings; test_ddp_fidelity.py asserts on them.
"""

from __future__ import annotations

import copy
import warnings
from collections import namedtuple
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ddp_fidelity_scenarios import Ours, TorchDDP, against_torch, diff, grads, spread
from paratrain.errors import ConfigError, DistributedError


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
