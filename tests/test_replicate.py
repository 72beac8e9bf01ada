from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.dp.replicate import Replicator, replicate
from paratrain.errors import ConfigError

CPU = torch.device("cpu")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("share", [True, False], ids=["shared-params", "copied-params"])
def test_gradients_of_all_replicas_sum_into_the_original(share):
    model = _mlp()
    x = torch.randn(9, 4)
    replicas = Replicator(model, [CPU] * 3, share_same_device=share).replicate()
    chunks = x.split([3, 3, 3])
    sum(r(c).pow(2).sum() for r, c in zip(replicas.modules, chunks, strict=True)).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).pow(2).sum().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad)


def test_replicas_are_distinct_objects_without_own_parameters():
    model = _mlp()
    reps = replicate(model, [CPU, CPU])
    assert reps[0] is not reps[1] and reps[0] is not model
    assert reps[0][0] is not model[0]
    assert list(reps[0].parameters()) == []  # like torch's replicas: tensors are plain attributes
    assert reps[0][0].weight is model[0].weight  # shared on the same device


def test_copied_parameters_are_not_leaves_and_keep_requires_grad():
    model = _mlp()
    model[2].bias.requires_grad_(False)
    rep = Replicator(model, [CPU], share_same_device=False).replicate().modules[0]
    assert rep[0].weight.grad_fn is not None
    assert not rep[2].bias.requires_grad


def test_tied_weights_stay_tied_in_replicas():
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head})
    rep = Replicator(model, [CPU] * 2, share_same_device=False).replicate().modules[1]
    assert rep["emb"].weight is rep["head"].weight


def test_a_parameter_registered_as_none_stays_none_and_forward_runs():
    """Linear(bias=False) registers its bias as None and reads it in forward: a replica without it failed with
    "'Linear' object has no attribute 'bias'" (found by the habit matrix, tied weights under dp)."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2, bias=False))
    replicas = Replicator(model, [CPU] * 2, share_same_device=False).replicate().modules
    x = torch.randn(3, 4)
    for rep in replicas:
        assert rep[2].bias is None
        assert torch.equal(rep(x), model(x))


def test_replica_objects_are_reused_until_the_structure_changes():
    model = _mlp()
    replicator = Replicator(model, [CPU] * 2)
    first = replicator.replicate()
    ids = [id(m) for m in first.modules]
    first.release()
    again = replicator.replicate()
    assert [id(m) for m in again.modules] == ids and replicator._builds == 1
    again.release()
    model.add_module("extra", nn.Identity())
    third = replicator.replicate()
    assert replicator._builds == 2
    assert hasattr(third.modules[0], "extra")
    # replacing a parameter object is a structure change too (tied weights might differ)
    model[0].weight = nn.Parameter(torch.zeros(8, 4))
    rep = replicator.replicate().modules[0]
    assert replicator._builds == 3 and torch.equal(rep[0].weight, torch.zeros(8, 4))


def test_reused_replicas_follow_mode_and_attribute_changes():
    model = nn.Sequential(nn.Dropout(0.5))
    replicator = Replicator(model, [CPU] * 2)
    assert replicator.replicate().modules[0][0].training
    model.eval()
    assert not replicator.replicate().modules[0][0].training
    model[0].p = 0.25
    assert replicator.replicate().modules[1][0].p == 0.25


def test_release_drops_tensor_references():
    model = _mlp()
    replicas = Replicator(model, [CPU] * 2).replicate()
    shells = replicas.modules
    replicas.release()
    assert shells[0][0].weight is None and shells[0]._buffers == {}


def test_every_replica_gets_its_own_copy_of_the_buffers():
    model = nn.BatchNorm1d(3)
    reps = Replicator(model, [CPU] * 3).replicate().modules
    assert all(r.running_mean is not model.running_mean for r in reps)
    assert reps[0].running_mean is not reps[1].running_mean
    assert torch.equal(reps[2].running_mean, model.running_mean)


def test_buffer_that_requires_grad_receives_gradients():
    model = nn.Module()
    model.register_buffer("scale", torch.tensor([2.0, 3.0], requires_grad=True))
    x = torch.ones(4, 2)
    for share in (True, False):
        model.scale.grad = None
        reps = Replicator(model, [CPU] * 2, share_same_device=share).replicate().modules
        sum((r.scale * c).sum() for r, c in zip(reps, x.split(2), strict=True)).backward()
        assert model.scale.grad.tolist() == [4.0, 4.0]


def test_sync_buffers_mean_is_the_whole_batch_update_for_running_mean():
    torch.manual_seed(0)
    x = torch.randn(10, 3) * 3 + 1
    model = nn.BatchNorm1d(3, momentum=0.5)
    reference = nn.BatchNorm1d(3, momentum=0.5)
    reference(x)
    replicas = Replicator(model, [CPU] * 3).replicate()
    sizes = [4, 3, 3]
    for rep, chunk in zip(replicas.modules, x.split(sizes), strict=True):
        rep(chunk)
    replicas.sync_buffers([s / 10 for s in sizes], "mean")
    torch.testing.assert_close(model.running_mean, reference.running_mean)
    assert model.num_batches_tracked.item() == 1


def test_sync_buffers_first_keeps_replica_zero():
    x = torch.randn(9, 3)
    model = nn.BatchNorm1d(3)
    expected = nn.BatchNorm1d(3)
    expected(x[:3])
    replicas = Replicator(model, [CPU] * 3).replicate()
    for rep, chunk in zip(replicas.modules, x.split(3), strict=True):
        rep(chunk)
    replicas.sync_buffers([1 / 3] * 3, "first")
    torch.testing.assert_close(model.running_mean, expected.running_mean)


def test_unchanged_buffers_keep_their_exact_values():
    model = nn.BatchNorm1d(3).eval()
    model.register_buffer("mask", torch.tensor([0.1, float("-inf"), float("inf")]))
    model.running_mean.fill_(0.1)
    before = [b.clone() for b in model.buffers()]
    replicas = Replicator(model, [CPU] * 3).replicate()
    for rep in replicas.modules:
        rep(torch.randn(2, 3))
    replicas.sync_buffers([0.3, 0.3, 0.4])
    for b, old in zip(model.buffers(), before, strict=True):
        assert torch.equal(b, old)


def test_buffer_changed_by_python_code_is_averaged():
    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("total", torch.zeros(2))
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            self.total += x.sum(0)
            self.calls += 1
            return x

    model = Counter()
    x = torch.arange(12.0).reshape(6, 2)
    replicas = Replicator(model, [CPU] * 3).replicate()
    for rep, chunk in zip(replicas.modules, x.split(2), strict=True):
        rep(chunk)
    replicas.sync_buffers([1 / 3] * 3)
    torch.testing.assert_close(model.total, x.sum(0) / 3)
    assert model.calls.item() == 1


def test_buffer_replaced_with_another_shape_keeps_replica_zero_with_a_warning():
    class Keeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("last", torch.zeros(0))

        def forward(self, x):
            self.last = x.detach()
            return x

    model = Keeper()
    x = torch.arange(5.0)
    replicas = Replicator(model, [CPU] * 2).replicate()
    for rep, chunk in zip(replicas.modules, x.split([3, 2]), strict=True):
        rep(chunk)
    with pytest.warns(UserWarning, match="replica 0's value is kept"):
        replicas.sync_buffers([0.6, 0.4])
    assert model.last.tolist() == [0.0, 1.0, 2.0]


def test_rnn_replicas_use_their_own_flat_weights():
    lstm = nn.LSTM(3, 4, batch_first=True)
    reps = Replicator(lstm, [CPU] * 2, share_same_device=False).replicate().modules
    assert reps[0]._flat_weights is not lstm._flat_weights
    assert reps[0]._flat_weights[0] is reps[0].weight_ih_l0
    assert lstm._flat_weights[0] is lstm.weight_ih_l0  # the original is untouched


def test_lazy_module_is_refused_with_advice():
    model = nn.Sequential(nn.LazyLinear(4))
    with pytest.raises(ConfigError, match=r"uninitialized.*run one forward pass"):
        replicate(model, [CPU, CPU])
