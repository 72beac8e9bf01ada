"""The reducer's state machine, driven directly in one process at world size 1 (a gloo group over a HashStore)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.ddp.reducer import Reducer
from paratrain.errors import DistributedError


@pytest.fixture
def model_and_reducer(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    monitor = CollectiveMonitor(group, 30.0, namespace="test-reducer")
    params = list(model.parameters())
    # a cap of 64 bytes: one bucket per few tensors, so the order of launches is visible
    reducer = Reducer(
        params,
        [str(i) for i in range(len(params))],
        group=group,
        monitor=monitor,
        bucket_cap_bytes=64,
        find_unused=False,
    )
    hooks = [p.register_post_accumulate_grad_hook(lambda _, i=i: reducer.on_grad(i)) for i, p in enumerate(params)]
    launched: list[int] = []
    launch = reducer._launch
    reducer._launch = lambda b: (launched.append(b), launch(b))[1]  # type: ignore[method-assign]
    yield model, reducer, launched
    for hook in hooks:
        hook.remove()
    monitor.close()


def _backward(model: nn.Module) -> None:
    model(torch.randn(3, 4)).sum().backward()


def test_a_synchronised_backward_launches_every_bucket_once_in_index_order(model_and_reducer):
    model, reducer, launched = model_and_reducer
    assert reducer.state == "idle" and len(reducer.buckets) > 2
    reducer.prepare(sync=True)
    assert reducer.state == "sync"
    _backward(model)
    assert launched == list(range(len(reducer.buckets)))
    assert reducer.state == "idle"  # the end-of-backward callback ran
    for p, view in zip(model.parameters(), reducer.collective.views, strict=True):
        assert torch.equal(p.grad, view)  # at world size 1 the average is the gradient itself


def test_a_local_backward_launches_nothing_and_leaves_gradients_alone(model_and_reducer):
    model, reducer, launched = model_and_reducer
    reducer.prepare(sync=False)
    assert reducer.state == "local"
    _backward(model)
    assert launched == [] and reducer.state == "local"  # finish() does nothing outside sync
    first = [p.grad.clone() for p in model.parameters()]
    reducer.prepare(sync=True)
    _backward(model)  # accumulates onto the local gradients, then synchronises the sum
    assert launched == list(range(len(reducer.buckets)))
    assert all(torch.all(p.grad != g) for p, g in zip(model.parameters(), first, strict=True))


def test_a_gradient_without_a_prepared_forward_is_refused(model_and_reducer):
    model, _, _ = model_and_reducer
    with pytest.raises(DistributedError, match="no forward through DistributedDataParallel prepared this backward"):
        _backward(model)


def test_a_parameter_without_a_gradient_is_named_without_find_unused(model_and_reducer):
    model, reducer, _ = model_and_reducer
    reducer.prepare(sync=True)
    with pytest.raises(DistributedError, match=r"1 parameter\(s\) received no gradient in this backward: 0"):
        model[0].weight.requires_grad_(False)
        try:
            _backward(model)
        finally:
            model[0].weight.requires_grad_(True)
    assert reducer.state == "idle"  # the next step starts clean


def test_a_profiler_trace_names_each_buckets_all_reduce(model_and_reducer):
    model, reducer, _ = model_and_reducer
    reducer.prepare(sync=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _backward(model)
    names = {event.name for event in prof.events()}
    for b in range(len(reducer.buckets)):
        assert f"paratrain::DistributedDataParallel.all_reduce (bucket {b})" in names
