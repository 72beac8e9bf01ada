"""The placeholder gradients of the sharded strategies: torch's utilities on them raise, naming the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.errors import ConfigError
from paratrain.sharded.guard import GradientGuard, ShardedGradient, ShardedGradientError


def _armed_model() -> tuple[nn.Module, GradientGuard]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    guard = GradientGuard("zero2")
    guard.arm(model.parameters())
    return model, guard


USES = {
    "torch clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
    "torch clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.1),
    "a hand-written norm": lambda m: sum(p.grad.norm() ** 2 for p in m.parameters()),
    "an unprepared SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).step(),
    "an unprepared AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=0.1).step(),
    "zero_grad(set_to_none=False)": lambda m: torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=False),
    "reading a value": lambda m: float(next(m.parameters()).grad.sum()),
}


@pytest.mark.parametrize("use", USES.values(), ids=USES.keys())
def test_every_use_of_a_sharded_gradient_raises_with_the_fix(use):
    model, _ = _armed_model()
    with pytest.raises(
        ShardedGradientError, match=r"under zero2 no rank holds .*par\.clip_grad_norm_\(model, max_norm\)"
    ):
        use(model)
    assert issubclass(ShardedGradientError, ConfigError)


def test_metadata_reads_as_a_gradient_and_costs_no_memory():
    model, guard = _armed_model()
    weight = model[0].weight
    assert isinstance(weight.grad, ShardedGradient) and weight.grad.shape == weight.shape
    assert weight.grad.dtype == weight.dtype and weight.grad.device == weight.device
    assert "ShardedGradient(shape=(3, 4)" in repr(weight.grad)
    guard.arm(model.parameters())
    assert weight.grad is guard.placeholder(weight)  # made once per parameter


def test_disarmed_parameters_take_gradients_again_and_zero_grad_removes_placeholders():
    model, guard = _armed_model()
    guard.disarm(model.parameters())
    assert all(p.grad is None for p in model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    assert all(isinstance(p.grad, torch.Tensor) and not guard.armed(p) for p in model.parameters())
    real = model[0].weight.grad
    guard.arm(model.parameters())
    assert model[0].weight.grad is real  # a real gradient is never replaced
    model2, _ = _armed_model()
    torch.optim.SGD(model2.parameters(), lr=0.1).zero_grad()  # set_to_none: the placeholders go
    assert all(p.grad is None for p in model2.parameters())


def test_frozen_parameters_get_no_placeholder():
    model = nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    GradientGuard("zero3").arm(model.parameters())
    assert isinstance(model.weight.grad, ShardedGradient) and model.bias.grad is None
