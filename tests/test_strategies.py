"""Strategies own what they wrap: unwrap knows, no_sync refuses strangers, collectives are watched."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.errors import ConfigError
from processes import run_ranks
from strategy_scenarios import a_metric_all_reduce_only_some_ranks_make


class WithModuleAttribute(nn.Module):
    """A user's model whose body is a submodule called ``module`` (a common name), beside a head."""

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.module(x)))


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu")])
def test_unwrap_returns_the_users_model_even_with_a_submodule_called_module(strategy, devices):
    torch.manual_seed(0)
    user = WithModuleAttribute()
    with paratrain.Parallel(strategy, devices) as par:
        model = par.prepare(user)
        assert par.unwrap(model) is user
        assert par.unwrap(user) is user  # the user's own object, too
        stranger = nn.Linear(2, 2)
        assert par.unwrap(stranger) is stranger


def test_clip_grad_norm_clips_the_whole_model_not_a_submodule_called_module():
    torch.manual_seed(0)
    with paratrain.Parallel("single", "cpu") as par:
        model = par.prepare(WithModuleAttribute())
        x, y = torch.randn(16, 6) * 100, torch.randint(0, 3, (16,))
        par.backward(F.cross_entropy(model(x), y))
        before = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        returned = par.clip_grad_norm_(model, 1.0)
        after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert before > 10 and torch.isclose(returned, before)
    assert after <= 1.0 + 1e-5  # every gradient was scaled, the head's too


@pytest.mark.parametrize("strategy, devices", [("single", "cpu"), ("dp", "cpu,cpu")])
def test_no_sync_on_a_model_the_strategy_did_not_wrap_is_an_error(strategy, devices):
    with paratrain.Parallel(strategy, devices) as par:
        prepared = par.prepare(nn.Linear(4, 2))
        with par.no_sync(prepared):
            pass
        with (
            pytest.raises(ConfigError, match=r"did not prepare.*par.prepare\(model\) returned"),
            par.no_sync(nn.Linear(4, 2)),
        ):
            pass


@pytest.mark.processes
@pytest.mark.slow
def test_a_metric_all_reduce_that_a_rank_skips_names_it(tmp_path):
    """The strategy's own collectives go through the same monitor as the gradients: the missing rank is named."""
    results = run_ranks(a_metric_all_reduce_only_some_ranks_make, 3, tmp_path, timeout=60)
    assert results[2] == "skipped"
    for message in results[:2]:
        assert "all_reduce (sum) of a float32 tensor of 4 elements" in message, message
        assert "did not complete within 2s" in message and "rank(s) 2 did not arrive" in message
        assert float(message.split("s:")[0]) < 10
