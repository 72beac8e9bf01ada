"""Mixed precision through Parallel: autocast where it belongs, float32 where the loop looks, the scaler's steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from ddp_scenarios import mlp
from paratrain.errors import ConfigError
from paratrain.loop.precision import PRECISIONS, select_precision


def _inner_dtypes(model: nn.Module) -> list[torch.dtype]:
    """Record the dtype of the first Linear's output on every forward (also inside dp's worker threads)."""
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda _m, _a, out: seen.append(out.dtype))
    return seen


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu")])
@pytest.mark.parametrize("precision, dtype", [("32", torch.float32), ("bf16-mixed", torch.bfloat16)])
def test_forward_runs_in_the_precision_and_returns_float32(strategy, devices, precision, dtype):
    inner = mlp()
    seen = _inner_dtypes(inner)
    with paratrain.Parallel(strategy, devices, precision=precision) as par:
        model = par.prepare(inner)
        out = model(torch.randn(6, 6))
        par.backward(F.cross_entropy(out, torch.randint(0, 4, (6,))))
    assert set(seen) == {dtype} and len(seen) == len(par.strategy.devices)
    assert out.dtype == torch.float32  # the loss is computed outside autocast, in float32
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in inner.parameters())
    assert not torch.is_autocast_enabled("cpu")  # nothing leaks out of the forward


def test_autocast_does_not_leak_when_forward_raises():
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            assert torch.is_autocast_enabled("cpu")
            raise ValueError("boom")

    with paratrain.Parallel("single", "cpu", precision="bf16-mixed") as par:
        model = par.prepare(Failing())
        with pytest.raises(ValueError, match="boom"):
            model(torch.randn(2, 3))
    assert not torch.is_autocast_enabled("cpu")


def test_16_mixed_skips_and_counts_steps_with_inf_gradients():
    inner = mlp()
    with paratrain.Parallel("single", "cpu", precision="16-mixed") as par:
        model = par.prepare(inner)
        optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        scale = par.precision.scaler.get_scale()
        x, y = torch.randn(4, 6), torch.randint(0, 4, (4,))

        before = [p.detach().clone() for p in inner.parameters()]
        par.backward(F.cross_entropy(model(x), y) * float("inf"))
        assert not par.clip_grad_norm_(model, 1.0).isfinite()  # the overflow shows in the norm; the step skips
        assert par.step(optimizer) is False
        assert par.precision.skipped_steps == 1
        assert all(torch.equal(a, p) for a, p in zip(before, inner.parameters(), strict=True))  # not applied
        assert par.precision.scaler.get_scale() == scale / 2  # the scale backed off
        optimizer.zero_grad()

        par.backward(F.cross_entropy(model(x), y))
        grad_norm = par.clip_grad_norm_(model, 100.0)  # the true norm: the scale is gone before clipping
        assert par.step(optimizer) is True and par.precision.skipped_steps == 1
        assert not all(torch.equal(a, p) for a, p in zip(before, inner.parameters(), strict=True))
    reference = mlp()
    F.cross_entropy(reference(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 100.0)
    torch.testing.assert_close(grad_norm, expected, rtol=1e-2, atol=0)  # float16 forward: about 3 digits


def test_16_mixed_refuses_a_plain_optimizer_step():
    with paratrain.Parallel("single", "cpu", precision="16-mixed") as par:
        model = par.prepare(mlp())
        optimizer = par.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
        par.backward(F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 4, (4,))))
        with pytest.raises(ConfigError, match=r"carry the loss scale: step with par.step\(optimizer\)"):
            optimizer.step()
        assert par.step(optimizer)


def test_scaler_state_round_trips():
    with paratrain.Parallel("single", "cpu", precision="16-mixed") as par:
        par.precision.scale(torch.ones(()))  # the scaler starts on its first loss
        par.precision.scaler.update(1024.0)
        par.precision.skipped_steps = 3
        state = par.precision.state_dict()
    fresh = select_precision("16-mixed", torch.device("cpu"))
    fresh.load_state_dict(state)
    assert fresh.scaler.get_scale() == 1024.0 and fresh.skipped_steps == 3


def test_unknown_or_unusable_precisions_say_what_to_use():
    with pytest.raises(ConfigError, match=r"unknown precision 'fp8'; choose one of: 32, bf16-mixed, 16-mixed"):
        paratrain.Parallel("single", "cpu", precision="fp8")
    # a device type torch cannot autocast on: refused, never silently run in float32
    with pytest.raises(ConfigError, match=r"precision '16-mixed' on meta: .*use precision bf16-mixed or 32"):
        select_precision("16-mixed", torch.device("meta"))
    assert PRECISIONS == ("32", "bf16-mixed", "16-mixed")
