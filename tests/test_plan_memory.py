"""plan's memory per device: the formula's table, the strategies' own allocations at world size 1, the sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from paratrain.ddp.distributed import DistributedDataParallel
from paratrain.errors import ConfigError
from paratrain.sharded.fully_sharded import MAX_REDUCING, FullyShardedDataParallel
from paratrain.sharded.guard import ShardedGradient
from paratrain.sharded.optimizer import shard_optimizer
from paratrain.sharded.zero import ZeroDataParallel
from paratrain.tools.plan_memory import (
    Zero3Unit,
    activation_bytes,
    memory_rows,
    parse_bytes,
    smallest_fit,
    zero3_backward_peak,
)


def _mlp(width: int = 512) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_model_states_follow_the_zero_formulas(world):
    """fp32 AdamW, Ψ parameters: ddp 16Ψ, zero1 8Ψ + 8Ψ/N, zero2 4Ψ + 12Ψ/N, zero3 16Ψ/N, plus padding and steps."""
    model = _mlp()
    psi = sum(p.numel() for p in model.parameters())
    rows = {r.strategy: r for r in memory_rows(model, "adamw", 0.0, [world], lambda n: 0)}
    formula = {
        "ddp": 16 * psi,
        "zero1": 8 * psi + 8 * psi / world,
        "zero2": 4 * psi + 12 * psi / world,
        "zero3": 16 * psi / world,
    }
    for strategy, expected in formula.items():
        assert rows[strategy].model_states == pytest.approx(expected, rel=1e-3), strategy
    assert rows["zero2"].in_flight > 0 and rows["zero3"].in_flight > 0 and rows["ddp"].in_flight == 0


def test_sgd_without_momentum_keeps_no_state():
    rows = memory_rows(_mlp(), "sgd", 0.0, [2], lambda n: 0)
    assert all(r.optimizer == 0 for r in rows)
    with_momentum = memory_rows(_mlp(), "sgd", 0.9, [2], lambda n: 0)
    assert all(r.optimizer > 0 for r in with_momentum) and len(with_momentum) == 4


def _held(tensors) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(storages.values())


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "zero3"])
def test_the_counts_are_what_the_strategies_allocate(group, strategy):
    """At world size 1, after a step: the bytes of parameters, gradients and optimizer state actually held."""
    model = _mlp()
    if strategy == "zero3":
        held = _held_by_zero3(model)
    elif strategy == "ddp":
        wrapped = DistributedDataParallel(model, gradient_as_bucket_view=True)  # as the ddp strategy wraps
        opt = torch.optim.AdamW(model.parameters())
    else:
        wrapped = ZeroDataParallel(model, int(strategy[-1]))
        opt = shard_optimizer(torch.optim.AdamW(model.parameters()), wrapped)
    if strategy != "zero3":
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
        collective = wrapped.reducer.collective
        # zero2's placeholders (ShardedGradient) stand in .grad without storage: nothing held
        grads = [p.grad for p in model.parameters() if not isinstance(p.grad, ShardedGradient)]
        grads += list(collective.buffers) + list(getattr(collective, "grads", []))
        held = {
            "parameters": _held(model.parameters()),
            "gradients": _held(grads),
            "optimizer": _held(v for s in opt.state.values() for v in s.values()),
        }
    (row,) = (r for r in memory_rows(_mlp(), "adamw", 0.0, [1], lambda n: 0) if r.strategy == strategy)
    assert held == {"parameters": row.parameters, "gradients": row.gradients, "optimizer": row.optimizer}


def _held_by_zero3(model: nn.Module) -> dict[str, int]:
    wrapped = FullyShardedDataParallel(model)
    opt = shard_optimizer(torch.optim.AdamW(model.parameters()), wrapped)
    x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
    F.cross_entropy(wrapped(x), y).backward()
    opt.step()
    held = {
        "parameters": _held(u.shard for u in wrapped.units),  # between steps: the shards, nothing gathered
        "gradients": _held(u.shard_grad for u in wrapped.units),
        "optimizer": _held(v for s in opt.state.values() for v in s.values()),
    }
    assert all(u.full.untyped_storage().nbytes() == 0 for u in wrapped.units)
    wrapped.close()
    return held


def test_activations_are_what_a_forward_saves_for_backward():
    model = _mlp(256)
    one, four = activation_bytes(model, torch.randn(1, 64), 1), activation_bytes(model, torch.randn(1, 64), 4)
    assert one > 0 and four == 4 * one  # saved inputs and ReLU outputs, per sample; the weights not counted
    assert four < sum(p.numel() * 4 for p in model.parameters())


@pytest.mark.parametrize(
    "text, size",
    [("80GB", 80 * 10**9), ("24GiB", 24 * 2**30), ("512 MB", 512 * 10**6), ("1.5gb", 15 * 10**8), ("4096", 4096)],
)
def test_sizes(text, size):
    assert parse_bytes(text) == size


def test_bad_sizes_and_the_fewest_devices():
    with pytest.raises(ConfigError, match="expected a size such as 80GB"):
        parse_bytes("eighty gigs")
    model = _mlp(1024)
    rows = memory_rows(model, "adamw", 0.0, range(1, 5), lambda n: 0)
    psi = sum(p.numel() for p in model.parameters())
    # 12Ψ: ddp never (16Ψ); zero1 from N=3 (8Ψ + 8Ψ/3); zero2 from N=4 (4Ψ + 12Ψ/4, and its three buckets in
    # flight while backward runs, 4Ψ for a model this small)
    fit = smallest_fit(rows, int(12 * psi))
    # zero3 (16Ψ/N) from N=3: its backward's peak holds, beyond its parts, the root's weights, two units' whole
    # weights (the one computing, the one prefetched) and one unit's whole gradient (gloo); the largest unit is
    # most of this model, so that does not shrink with N
    assert fit == {"ddp": None, "zero1": 3, "zero2": 4, "zero3": 3}


def test_zero3s_backward_peak_follows_the_units_in_reverse_with_the_gradient_parts_already_reduced():
    """Four units of 100 bytes (50 per rank at N=2) and a root of 10: the root's backward first, then the units
    last to first; at each, the parts reduced so far, the root's weights, the unit's and the next one's (prefetched),
    the unit's whole gradient and the one before it less its part (its reduce in flight); on NCCL also the unit's
    flat copy of its gradient."""
    units = [Zero3Unit(10, 5, root=True), *(Zero3Unit(100, 50) for _ in range(4))]
    # the root: 10 + 100 (prefetched) + 10; then done 5, 55, 105, 155 beside 10 + 100 + 100 + 100 + the one before
    # less its part (5, then 50), the last with no next
    peaks = [120, 5 + 310 + 5, 55 + 310 + 50, 105 + 310 + 50, 155 + 210 + 50]
    assert MAX_REDUCING == 1 and zero3_backward_peak(units, "gloo") == max(peaks) == 465
    assert zero3_backward_peak(units, "nccl") == 465 + 100
    frozen = [Zero3Unit(100, 50, trains=False), Zero3Unit(100, 50)]  # no gradient of its own, none reduced
    assert zero3_backward_peak(frozen, "gloo") == max(100 + 100 + 100, 50 + 100 + 50)


def test_zero3_in_flight_is_its_backward_peak_beyond_its_gradient_parts():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(512, 512) for _ in range(4)))  # four units of 262,656 parameters, no root
    unit = 262_656 * 4
    (gloo,) = (r for r in memory_rows(model, "adamw", 0.0, [2], lambda n: 0, backend="gloo") if r.strategy == "zero3")
    (nccl,) = (r for r in memory_rows(model, "adamw", 0.0, [2], lambda n: 0, backend="nccl") if r.strategy == "zero3")
    # the peak at the third unit: two parts reduced, two units' weights, one whole gradient and the half of the one
    # before still reducing; less the four parts
    assert gloo.gradients == 4 * unit // 2 and gloo.in_flight == (unit + 3 * unit + unit // 2) - 2 * unit
    assert nccl.in_flight == gloo.in_flight + unit and nccl.model_states == gloo.model_states
