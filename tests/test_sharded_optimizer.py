"""The sharded optimizer and the zero wrappers in one process, at world size 1 (a gloo group over a HashStore).

One rank owns every piece, so each test has an exact oracle: torch's own optimizer on the plain model. The
sharding across ranks is tested in real processes (tests/test_zero.py); here: the class, the groups, the hooks,
the bucket-by-bucket step, state dicts, and what is refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from paratrain.checkpoint.sharded import LocalSlices, Owned
from paratrain.errors import ConfigError
from paratrain.sharded.optimizer import ShardedOptimizer, check_elementwise, shard_optimizer
from paratrain.sharded.zero import ZeroDataParallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))


def _groups(model: nn.Module) -> list[dict]:
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "weight_decay": 0.0, "lr": 1e-2}]


def _wrapped(group, stage: int) -> ZeroDataParallel:
    # a cap of 1 KiB: three buckets, so the step runs bucket by bucket
    return ZeroDataParallel(_model(), stage, bucket_cap_mb=1 / 1024, timeout=30)


def _batches(n: int = 4):
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(
    "make",
    [
        lambda groups: torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.1),
        lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
        lambda groups: torch.optim.Adam(groups, lr=1e-3, amsgrad=True),
    ],
    ids=["adamw", "sgd-nesterov", "adam-amsgrad"],
)
def test_training_equals_torch_bit_for_bit_and_the_class_and_groups_are_kept(group, stage, make):
    plain = _model()
    plain_opt = make(_groups(plain))
    wrapped = _wrapped(group, stage)
    assert len(wrapped.reducer.buckets) >= 3
    user = make(_groups(wrapped.module))
    opt = shard_optimizer(user, wrapped)
    assert (
        isinstance(opt, type(user)) and isinstance(opt, ShardedOptimizer) and type(opt).__name__ == type(user).__name__
    )
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in user.param_groups
    ]
    for x, y in _batches():
        for model, optimizer in ((plain, plain_opt), (wrapped, opt)):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(next(plain.parameters()), next(_model().parameters()))  # training moved them


def test_the_weights_are_views_of_one_flat_buffer_per_bucket(group):
    wrapped = _wrapped(group, 2)
    for bucket, flat in zip(wrapped.reducer.buckets, wrapped.flat, strict=True):
        for i in bucket.indices:
            p = wrapped.reducer.params[i]
            assert p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_step_hooks_run_once_per_step_though_the_update_runs_per_bucket(group):
    """The HACK in sharded_optimizer._unhooked: torch's hook wrapper around a class's step is stepped around."""
    wrapped = _wrapped(group, 1)
    opt = shard_optimizer(torch.optim.SGD(wrapped.module.parameters(), lr=0.1), wrapped)
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    for x, y in _batches(2):
        F.cross_entropy(wrapped(x), y).backward()
        opt.step()
    assert calls == ["pre", "post", "pre", "post"]


def test_state_dicts_own_canonical_and_whole(group):
    wrapped = _wrapped(group, 2)
    opt = shard_optimizer(torch.optim.AdamW(_groups(wrapped.module), lr=1e-3), wrapped)
    plain = copy.deepcopy(_model())
    plain_opt = torch.optim.AdamW(_groups(plain), lr=1e-3)
    for x, y in _batches(2):
        for model, optimizer in ((plain, plain_opt), (wrapped, opt)):
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    own = opt.state_dict()
    assert own["paratrain_shard"].startswith("rank 0 of 1")
    opt.load_state_dict(own)  # the same layout loads back
    canonical = opt.sharded_state_dict()
    expected = plain_opt.state_dict()
    assert canonical["param_groups"] == expected["param_groups"]
    assert sorted(canonical["state"]) == sorted(expected["state"])
    for i, entry in canonical["state"].items():
        assert isinstance(entry["step"], Owned) and torch.equal(entry["step"].value, expected["state"][i]["step"])
        slices = entry["exp_avg"]
        assert isinstance(slices, LocalSlices) and slices.shape == tuple(expected["state"][i]["exp_avg"].shape)
        ((start, values),) = slices.slices
        assert start == 0 and torch.equal(values, expected["state"][i]["exp_avg"].reshape(-1))
    fresh = _wrapped(group, 2)
    again = shard_optimizer(torch.optim.AdamW(_groups(fresh.module), lr=1e-3), fresh)
    again.load_state_dict(expected)  # a whole optimizer's state dict, as single or ddp saves it
    for mine, theirs in zip(again._shard.values, opt._shard.values, strict=True):
        assert all(torch.equal(again.state[mine][k], opt.state[theirs][k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    with pytest.raises(ValueError, match="another layout"):
        again.load_state_dict({**own, "paratrain_shard": "rank 1 of 4, pieces 0"})
    with pytest.raises(ValueError, match="parameter groups"):
        again.load_state_dict({**expected, "param_groups": expected["param_groups"][:1]})


def test_state_the_users_optimizer_already_holds_is_sliced_in(group):
    model = _model()
    user = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = _batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    user.step()
    momentum = [user.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    wrapped = ZeroDataParallel(model, 1, bucket_cap_mb=1 / 1024, timeout=30)
    opt = shard_optimizer(user, wrapped)
    shard = opt._shard
    held = {
        id(piece.param): opt.state[value]["momentum_buffer"]
        for piece, value in zip(shard.pieces, shard.values, strict=True)
    }
    for p, expected in zip(model.parameters(), momentum, strict=True):
        assert torch.equal(held[id(p)], expected.reshape(-1))


class _Lars(torch.optim.SGD):
    """Scales each parameter's update by its norm: not elementwise."""

    def step(self, closure=None):  # type: ignore[override]
        return super().step(closure)


class _Declared(_Lars):
    paratrain_elementwise = True


class _PlainSubclass(torch.optim.Adam):
    pass


def test_only_elementwise_optimizers_are_taken():
    check_elementwise(torch.optim.AdamW)
    check_elementwise(_PlainSubclass)  # keeps Adam's update
    check_elementwise(_Declared)
    with pytest.raises(ConfigError, match="found _Lars, which paratrain does not know to update element by element"):
        check_elementwise(_Lars)
    with pytest.raises(ConfigError, match="found LBFGS: its step evaluates the loss again"):
        check_elementwise(torch.optim.LBFGS)
    with pytest.raises(ConfigError, match="SparseAdam: it takes sparse gradients"):
        check_elementwise(torch.optim.SparseAdam)


def test_what_the_zero_wrapper_refuses(group):
    wrapped = _wrapped(group, 2)
    opt = shard_optimizer(torch.optim.SGD(wrapped.module.parameters(), lr=0.1), wrapped)
    with pytest.raises(ConfigError, match="give every parameter group to the optimizer before preparing it"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(ConfigError, match="join\\(\\) is not supported under zero2"):
        wrapped.join()
    with pytest.raises(ConfigError, match="communication hooks are not supported under zero2"):
        wrapped.register_comm_hook(None, lambda s, b: None)
    with pytest.raises(ConfigError, match="ZeRO stage must be 1"):
        ZeroDataParallel(_model(), 3)
    with pytest.raises(ConfigError, match="does not train"):
        shard_optimizer(torch.optim.SGD(_model().parameters(), lr=0.1), wrapped)


def test_zero2_buckets_without_a_buffer_hold_an_empty_one_of_their_own_dtype_and_device(group):
    """Between backwards a zero2 bucket has no buffer: what stands in is its own, of its dtype and device."""
    wrappers = [ZeroDataParallel(_model().double(), 2, bucket_cap_mb=1 / 1024, timeout=30) for _ in range(2)]
    x, y = _batches(1)[0]
    F.cross_entropy(wrappers[0](x.double()), y).backward()  # buffers taken and given back
    seen: set[int] = set()
    for wrapped in wrappers:
        collective = wrapped.reducer.collective
        for bucket, buffer in zip(collective.buckets, collective.buffers, strict=True):
            assert buffer.numel() == 0
            assert (buffer.dtype, buffer.device) == (bucket.dtype, bucket.device) == (torch.float64, wrapped.device)
            assert all(collective.views[i] is buffer for i in bucket.indices)
            assert id(buffer) not in seen  # no tensor shared with another bucket or another wrapper
            seen.add(id(buffer))
