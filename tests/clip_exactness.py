"""``par.clip_grad_norm_`` against torch's ``clip_grad_norm_`` on torch's DDP, on every rank of one launch (issue 25).

The reference is what a torch DDP script does: ``loss.backward()``, then
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)``, then the step. Each paratrain strategy runs the same
steps through ``Parallel`` (``par.backward``, ``par.clip_grad_norm_``, the step) on the same per-rank batches; every
step's norm and the final weights are compared bit for bit. The model's layers are large enough that a norm summed
another way (float64 terms, or each rank's pieces) differs from torch's in float32's last bit on most steps.
"""

from __future__ import annotations

import copy
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.environment import ClusterEnvironment
from paratrain.strategies.ddp import _init_process_group

STEPS = 20
MAX_NORM = 0.05  # below every step's norm: every step clips
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")


def model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(48, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 10))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(16, 48, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]


def _flat(module: nn.Module) -> torch.Tensor:
    """The weights from ``state_dict()``: whole under every strategy (zero3 gathers them; every rank calls it)."""
    return torch.cat([t.detach().reshape(-1) for t in module.state_dict().values()])


def _torch_ddp(base: nn.Module, rank: int) -> tuple[list[float], torch.Tensor]:
    net = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    norms = []
    for x, y in batches(rank):
        F.cross_entropy(net(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)))
        optimizer.step()
        optimizer.zero_grad()
    return norms, _flat(net.module)


def _ours(strategy: str, base: nn.Module, rank: int) -> tuple[list[float], torch.Tensor, int]:
    with paratrain.Parallel(strategy, "cpu", timeout=120) as par:
        net = copy.deepcopy(base)
        model, optimizer = par.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        norms, measured = [], 0
        for x, y in batches(rank):
            par.backward(F.cross_entropy(model(x), y))
            scatter = getattr(model, "_scatter", None)
            measured += bool(scatter is not None and scatter._measured)  # zero2: measured while reduced, no gather
            norms.append(float(par.clip_grad_norm_(model, MAX_NORM)))
            optimizer.step()
            optimizer.zero_grad()
        return norms, _flat(net), measured


def against_torch(rank: int) -> dict[str, Any]:
    """Per strategy: steps whose norm is torch's bit for bit, weights bitwise equal, the largest difference."""
    base = model()
    created = not dist.is_initialized()
    if created:
        # as Parallel initialises its groups: the Parallels before this one in the process destroyed theirs, and
        # torch's default keys in the launcher's store are theirs (a plain init_process_group may read a stale
        # address and wait forever, as it did here)
        _init_process_group(ClusterEnvironment.detect(), "gloo", timedelta(seconds=120))
    try:
        reference_norms, reference = _torch_ddp(base, rank)
    finally:
        if created:
            dist.destroy_process_group()
    found: dict[str, Any] = {"clipped_steps": sum(n > MAX_NORM for n in reference_norms), "steps": STEPS}
    for strategy in STRATEGIES:
        norms, weights, measured = _ours(strategy, base, rank)
        found[strategy] = {
            "same_norms": sum(a == b for a, b in zip(norms, reference_norms, strict=True)),
            "bitwise": bool(torch.equal(weights, reference)),
            "max_diff": float((weights - reference).abs().max()),
            "measured_in_backward": measured,
        }
    return found
