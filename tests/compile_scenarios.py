"""torch.compile under every process strategy (issue 51): a model compiled before ``prepare``
(``torch.compile(model)``), in place (``model.compile()``) or after it (``torch.compile(prepared)``), trained with
the habits (``par.accumulate``, which runs ``no_sync`` on the model given, and ``par.clip_grad_norm_``), against the
same script run eagerly under ddp. The backend is ``aot_eager`` behind a counter: dynamo traces and AOTAutograd
splits forward and backward as inductor's would, without inductor's C++ build time (the tests stay inside make
test's budget), and the counter shows that something was compiled and that nothing was compiled again after the
second step. The model is a class of the user's: dynamo compiles nothing of a bare ``nn.Sequential`` under a
data-parallel wrapper (torch's own DDP included), whose frames are all torch's.

:func:`overlap` is the compiled backward in pieces: the order in which a DDP's communication hook sees its buckets
and autograd computes the first layer's gradient.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ORDERS = ("eager", "before", "in place", "after")


class Counting:
    """A dynamo backend: ``aot_eager``, counting the graphs it is given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs += 1
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2, inputs: int = 6, classes: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(inputs, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth - 1))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.hidden:
            x = torch.tanh(layer(x))
        return self.out(x)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def _graph_breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def train(strategy: str, order: str) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    backend = Counting()
    # fullgraph=True wherever docs/compile.md says it works: dynamo raises at any graph break
    options = {"backend": backend, "fullgraph": (strategy, order) != ("zero3", "after")}
    with paratrain.Parallel(strategy, "cpu", timeout=120) as par:
        net = _mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if order == "before":
            net = torch.compile(net, **options)
        elif order == "in place":
            net.compile(**options)
        model, optimizer, loader = par.prepare(net, optimizer, _data())
        if order == "after":
            model = torch.compile(model, **options)
        norms, graphs = [], []
        for batch in loader:
            for x, y in par.accumulate(model, batch, 2):
                par.backward(F.cross_entropy(model(x), y))
            norms.append(float(par.clip_grad_norm_(model, 0.5)))
            optimizer.step()
            optimizer.zero_grad()
            graphs.append(backend.graphs)
        state = par.unwrap(model).state_dict()  # zero3: gathered, on every rank
        return {
            "norms": norms,
            "weights": torch.cat([state[k].reshape(-1) for k in sorted(state)]).tolist(),
            "keys": sorted(state),
            "graphs": graphs,  # the graphs compiled by the end of each step
            "breaks": _graph_breaks(),
            "reasons": [k.splitlines()[0] for k in torch._dynamo.utils.counters["graph_break"]],
        }


def matrix(rank: int, world: int, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Every order under ``strategies``, and the eager ddp run they are compared with."""
    cells = {"ddp/eager": train("ddp", "eager")}
    cells.update({f"{s}/{o}": train(s, o) for s in strategies for o in ORDERS if (s, o) != ("ddp", "eager")})
    return cells


def _overlap_run(order: str) -> dict[str, Any]:
    """Six 512x512 layers (1 MiB each) in 1 MiB buckets: what the comm hook and the first layer's gradient saw."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    backend = Counting()
    net = Net(width=512, depth=6, inputs=512, classes=512)
    events: list[str] = []
    net.inp.weight.register_hook(lambda grad: events.append("first layer"))

    def hook(state: object, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        events.append(f"bucket {bucket.index()}")
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())  # the sum itself is not what this scenario looks at
        return done

    if order == "before":
        net = torch.compile(net, backend=backend)
    elif order == "in place":
        net.compile(backend=backend)
    model = paratrain.DistributedDataParallel(net, bucket_cap_mb=1)
    model.register_comm_hook(None, hook)
    run = torch.compile(model, backend=backend) if order == "after" else model
    told = io.StringIO()
    for _ in range(2):
        events.clear()
        with contextlib.redirect_stderr(told):
            run(torch.randn(4, 512)).sum().backward()
    return {"events": list(events), "graphs": backend.graphs, "told": told.getvalue()}


def overlap(rank: int, world: int, orders: tuple[str, ...] = (*ORDERS[1:], "one piece")) -> dict[str, Any]:
    """Each of ``orders`` with dynamo's cutting on (the default); "one piece": "before" with it turned off."""
    assert dist.get_world_size() == world
    found = {order: _overlap_run(order) for order in orders if order != "one piece"}
    if "one piece" in orders:
        with torch._dynamo.config.patch(optimize_ddp=False):
            found["one piece"] = _overlap_run("before")
    return found
