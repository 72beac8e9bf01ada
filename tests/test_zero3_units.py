"""zero3's units (a pure function of the model, table-tested) and the wrapper in one process (world size 1).

The process tests (tests/test_zero3.py) compare zero3 with ddp across ranks; here: which modules become units and
who holds a tied weight, and at world size 1 (a one-rank gloo group) training equal to the plain model's bit for
bit, the state dict round trip, a meta-device build, and the errors.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from paratrain.errors import ConfigError, DistributedError
from paratrain.sharded.fully_sharded import FullyShardedDataParallel
from paratrain.sharded.guard import ShardedWeightError
from paratrain.sharded.optimizer import shard_optimizer
from paratrain.sharded.units import plan_units
from zero3_scenarios import Block, TinyGPT, build
from zero_scenarios import model as mlp


def _names(plan):
    return [(u.name, list(u.names)) for u in plan]


def test_the_default_policy_makes_units_of_large_blocks_and_the_root_holds_the_rest():
    plan = plan_units(mlp())  # Sequential: 64x512 (33k), 512x512 (262k) twice, 512x10 (5k)
    assert _names(plan) == [
        ("", ["0.weight", "0.bias", "6.weight", "6.bias"]),
        ("2", ["2.weight", "2.bias"]),
        ("4", ["4.weight", "4.bias"]),
    ]
    assert [u.name for u in plan_units(mlp(), min_params=1)] == ["0", "2", "4", "6"]  # the root holds nothing
    assert [u.name for u in plan_units(mlp(), min_params=10**9)] == [""]


def test_blocks_of_a_module_list_deep_inside_become_units():
    plan = plan_units(TinyGPT(), min_params=1000)
    assert [u.name for u in plan] == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    root = dict(zip(plan[0].names, plan[0].params, strict=True))
    assert set(root) == {
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    }  # lm_head.weight is wte's, listed once


def test_a_weight_tied_across_units_is_held_by_the_innermost_unit_holding_both():
    model = TinyGPT()
    plan = plan_units(model, [Block, "transformer.wte", "lm_head"])
    assert [u.name for u in plan] == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert model.lm_head.weight in plan[0].params  # the root: wte's and lm_head's units hold nothing, left out
    nested = plan_units(model, ["transformer", "transformer.wte"])  # lm_head is the root's: so is the tied weight
    assert [u.name for u in nested] == ["", "transformer"] and model.lm_head.weight in nested[0].params


def test_the_users_units_nest():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    plan = plan_units(model, ["0", "0.1"])
    assert _names(plan) == [
        ("", ["1.weight", "1.bias"]),
        ("0", ["0.0.weight", "0.0.bias"]),
        ("0.1", ["0.1.weight", "0.1.bias"]),
    ]


@pytest.mark.parametrize(
    "units, message",
    [
        (["blocks.9"], "zero3 unit 'blocks.9' is not a module of the model"),
        ([nn.Conv2d], "no module of the model is one"),
        ([3], "module classes or qualified module names; found int 3"),
    ],
)
def test_units_that_do_not_fit_the_model(units, message):
    with pytest.raises(ConfigError, match=message):
        plan_units(mlp(), units)


def test_a_unit_of_two_dtypes_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    with pytest.raises(ConfigError, match="several dtypes or devices"):
        plan_units(model)


def _train(model, wrap: bool, steps: int = 3):
    torch.manual_seed(5)
    net = FullyShardedDataParallel(model, min_params=1000) if wrap else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = shard_optimizer(opt, net) if wrap else opt
    for _ in range(steps):
        x, y = torch.randn(8, 64), torch.randint(0, 10, (8,))
        F.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in net.module.state_dict().items()} if wrap else model.state_dict(), net


def test_one_rank_trains_as_the_plain_model_and_its_state_dict_round_trips(group):
    plain, _ = _train(build("bn"), wrap=False)
    sharded, net = _train(build("bn"), wrap=True)
    assert sharded.keys() == plain.keys() and all(torch.equal(sharded[k], plain[k]) for k in plain)
    for p in net.module.parameters():  # between uses: no values held, and a read says what to do instead
        with pytest.raises(ShardedWeightError, match=r"par\.full_weights\(model\)"):
            p.detach().clone()
        assert tuple(p.shape) == tuple(plain[next(k for k, q in net.module.named_parameters() if q is p)].shape)
    net.module.load_state_dict({k: torch.zeros_like(v) for k, v in plain.items()})
    assert all(not v.any() for v in net.module.state_dict().values())
    net.close()


def test_a_meta_model_is_built_as_a_plain_one(group):
    torch.manual_seed(0)
    plain = TinyGPT().state_dict()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT()
    net = FullyShardedDataParallel(model, min_params=1000)
    state = net.module.state_dict()
    assert state.keys() == plain.keys() and all(torch.equal(state[k], plain[k]) for k in plain)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    net.close()


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def test_a_meta_module_without_reset_parameters_is_refused(group):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), _NoReset())
    with pytest.raises(ConfigError, match="reset_parameters\\(\\), which 1 does not have"):
        FullyShardedDataParallel(model)


def test_reentrant_checkpointing_is_refused(group):
    from torch.utils.checkpoint import checkpoint

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(checkpoint(self.a, x, use_reentrant=True) + checkpoint(self.a, x, use_reentrant=True))

    net = FullyShardedDataParallel(Twice(), min_params=10**9)
    with pytest.raises(DistributedError, match="received its gradient twice in one backward"):
        net(torch.randn(2, 4, requires_grad=True)).sum().backward()
    net.close()


def test_bad_options(group):
    with pytest.raises(ConfigError, match="prefetch counts units gathered ahead"):
        FullyShardedDataParallel(mlp(), prefetch=-1)
