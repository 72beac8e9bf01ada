"""What each rank runs in the tests of zero1 and zero2 (tests/test_zero.py); every function returns JSON-able findings.

The oracle is our DDP in the same processes, on the same model, data and optimizer: parameters after every step
compared bit for bit, and one device on the whole batches within rounding.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.errors import ConfigError
from paratrain.sharded_optimizer import ShardedOptimizer
from paratrain.zero import ZeroDataParallel
from paratrain.zero_reducer import ShardedReducer

GLOBAL_BATCH = 24
STEPS = 3


def model(seed: int = 0) -> nn.Module:
    """About 560k parameters: two buckets (the first small), every world size splits a parameter between ranks."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 10)
    )


def batches(steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, 64, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def optimizer_for(name: str, net: nn.Module) -> torch.optim.Optimizer:
    """Two parameter groups with settings of their own (the biases without weight decay, another lr)."""
    weights = [p for n, p in net.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in net.named_parameters() if n.endswith("bias")]
    if name == "sgd":
        return torch.optim.SGD(
            [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 0.05}],
            lr=0.1,
            momentum=0.9,
            weight_decay=1e-3,
        )
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=3e-3, weight_decay=0.1)


def flat_params(par: paratrain.Parallel, net: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in par.unwrap(net).parameters()]).clone()


def train(
    strategy: str,
    *,
    optimizer: str,
    precision: str = "32",
    accumulate: int = 1,
    clip: float | None = None,
    schedule: bool = False,
    steps: int = STEPS,
) -> dict[str, Any]:
    """Train under ``strategy``; the parameters after every step, the clipping norms, the shard's state size."""
    with paratrain.Parallel(strategy, "cpu", precision=precision) as par:
        net = model()
        opt = optimizer_for(optimizer, net)
        net, opt, loader = par.prepare(net, opt, batches(steps))
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)) if schedule else None
        after, norms = [], []
        for x, y in loader:
            for xm, ym in par.accumulate(net, (x, y), steps=accumulate):
                par.backward(F.cross_entropy(net(xm), ym))
            if clip is not None:
                norms.append(float(par.clip_grad_norm_(net, clip)))
            par.step(opt)
            opt.zero_grad()
            if scheduler is not None:
                scheduler.step()
            after.append(flat_params(par, net))
        state = sum(v.numel() for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
        return {"after": after, "norms": norms, "state_numel": state, "lr": [g["lr"] for g in opt.param_groups]}


CONFIGS: dict[str, dict[str, Any]] = {
    "sgd momentum, fp32": {"optimizer": "sgd"},
    "adamw, fp32": {"optimizer": "adamw"},
    "sgd momentum, bf16-mixed": {"optimizer": "sgd", "precision": "bf16-mixed"},
    "adamw, bf16-mixed": {"optimizer": "adamw", "precision": "bf16-mixed"},
    "sgd momentum, accumulate 2, clip": {"optimizer": "sgd", "accumulate": 2, "clip": 0.05},
    "adamw, bf16-mixed, accumulate 3, clip, schedule": {
        "optimizer": "adamw",
        "precision": "bf16-mixed",
        "accumulate": 3,
        "clip": 0.5,
        "schedule": True,
    },
}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def exactness(rank: int, world: int) -> dict[str, Any]:
    """Every configuration under single, ddp, zero1 and zero2: bitwise equality with ddp, closeness to one device."""
    found = {}
    for name, config in CONFIGS.items():
        runs = {strategy: train(strategy, **config) for strategy in ("single", "ddp", "zero1", "zero2")}
        ddp = runs["ddp"]
        entry: dict[str, Any] = {"moved": _relative(ddp["after"][-1], flat_params_initial())}
        for strategy in ("zero1", "zero2"):
            run = runs[strategy]
            entry[f"{strategy}_bitwise"] = all(
                torch.equal(a, b) for a, b in zip(run["after"], ddp["after"], strict=True)
            )
            entry[f"{strategy}_rel"] = max(_relative(a, b) for a, b in zip(run["after"], ddp["after"], strict=True))
            entry[f"{strategy}_norms"] = run["norms"] == ddp["norms"]
            entry[f"{strategy}_state"] = run["state_numel"]
            entry[f"{strategy}_lr"] = run["lr"] == ddp["lr"]
        entry["ddp_state"] = ddp["state_numel"]
        entry["single_rel"] = max(
            _relative(a, b) for a, b in zip(runs["single"]["after"], ddp["after"], strict=True)
        )
        found[name] = entry
    return found


def flat_params_initial() -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model().parameters()])


def suite(rank: int, world: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for scenario in (exactness,):
        found[scenario.__name__] = scenario(rank, world)
    return found
