"""torch.compile under every process strategy (issue 51, in part): a model compiled before ``prepare``
(``torch.compile(model)``), in place (``model.compile()``) or after it (``torch.compile(prepared)``), trained with
the habits (``par.accumulate``, which runs ``no_sync`` on the model given, and ``par.clip_grad_norm_``), against the
same script run eagerly under ddp. The backend is ``aot_eager``: dynamo traces and AOTAutograd splits forward and
backward as inductor's would, without inductor's C++ build time (the tests stay inside make test's budget).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import paratrain

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ORDERS = ("eager", "before", "in place", "after")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(3)]


def train(strategy: str, order: str) -> dict[str, Any]:
    torch._dynamo.reset()
    with paratrain.Parallel(strategy, "cpu", timeout=120) as par:
        net = _mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        if order == "before":
            net = torch.compile(net, backend="aot_eager")
        elif order == "in place":
            net.compile(backend="aot_eager")
        model, optimizer, loader = par.prepare(net, optimizer, _data())
        if order == "after":
            model = torch.compile(model, backend="aot_eager")
        norms = []
        for batch in loader:
            for x, y in par.accumulate(model, batch, 2):
                par.backward(F.cross_entropy(model(x), y))
            norms.append(float(par.clip_grad_norm_(model, 0.5)))
            optimizer.step()
            optimizer.zero_grad()
        state = par.unwrap(model).state_dict()  # zero3: gathered, on every rank
        return {
            "norms": norms,
            "weights": torch.cat([state[k].reshape(-1) for k in sorted(state)]).tolist(),
            "keys": sorted(state),
        }


def matrix(rank: int, world: int, strategies: tuple[str, ...] = STRATEGIES) -> dict[str, Any]:
    """Every order under ``strategies``, and the eager ddp run they are compared with."""
    cells = {"ddp/eager": train("ddp", "eager")}
    cells.update({f"{s}/{o}": train(s, o) for s in strategies for o in ORDERS if (s, o) != ("ddp", "eager")})
    return cells
