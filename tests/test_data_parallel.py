"""DataParallel against the oracle: the same training on one device, with CPU replicas in threads."""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from conftest import assert_close_lists, assert_same_training, grads_of
from models_for_tests import (
    ConvNet,
    DataclassNet,
    DictNet,
    EmbeddingNet,
    Features,
    GradBufferNet,
    KeywordOnlyNet,
    LSTMNet,
    NamedTupleNet,
    SimpleNet,
    TanhNet,
)
from paratrain import DataParallel
from paratrain.errors import ConfigError, DeviceError, GatherError, ScatterError

STEPS = 5
BATCH = 10  # uneven over 3 and 4 replicas: [4, 3, 3] and [3, 3, 2, 2]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


def _classification(shape, classes, g):
    return [
        ((torch.randn(BATCH, *shape, generator=g),), {}, torch.randint(0, classes, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _ce(out, target):
    return F.cross_entropy(out, target)


def case_simplenet():
    return SimpleNet, _classification((784,), 10, _gen()), _ce


def case_convnet():
    return ConvNet, _classification((1, 8, 8), 10, _gen()), _ce


def case_lstm():
    return LSTMNet, _classification((5, 6), 3, _gen()), _ce


def _tokens():
    g = _gen()
    return [
        ((torch.randint(0, 20, (BATCH, 6), generator=g),), {}, torch.randint(0, 3, (BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def case_embedding_dense():
    return (lambda: EmbeddingNet(sparse=False)), _tokens(), _ce


def case_embedding_sparse():
    return (lambda: EmbeddingNet(sparse=True)), _tokens(), _ce


def case_dict():
    g = _gen()
    batches = [
        (
            ({"x": torch.randn(BATCH, 4, generator=g), "w": torch.rand(BATCH, generator=g), "tag": "t"},),
            {},
            torch.randint(0, 3, (BATCH,), generator=g),
        )
        for _ in range(STEPS)
    ]

    def loss(out, target):
        assert out["kind"] == "dict"
        return F.cross_entropy(out["logits"], target) + out["aux"]["norm"].mean()

    return DictNet, batches, loss


def case_namedtuple():
    g = _gen()
    batches = [((torch.randn(BATCH, 4, generator=g),), {}, torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]
    return NamedTupleNet, batches, lambda out, t: F.mse_loss(out.logits, t) + out.hidden.pow(2).mean()


def case_dataclass():
    g = _gen()
    batches = [
        (
            (Features(torch.randn(BATCH, 4, generator=g), torch.rand(BATCH, generator=g)),),
            {},
            torch.randn(BATCH, 3, generator=g),
        )
        for _ in range(STEPS)
    ]
    return DataclassNet, batches, lambda out, t: F.mse_loss(out.x, t)


def case_keyword_only():
    g = _gen()
    batches = [
        (
            (torch.randn(BATCH, 4, generator=g),),
            {"scale": torch.rand(BATCH, 1, generator=g), "mask": torch.ones(BATCH, 3), "offset": 0.5},
            torch.randn(BATCH, 3, generator=g),
        )
        for _ in range(STEPS)
    ]
    return KeywordOnlyNet, batches, lambda out, t: F.mse_loss(out, t)


def case_grad_buffer():
    g = _gen()
    batches = [((torch.randn(BATCH, 4, generator=g),), {}, torch.randn(BATCH, 3, generator=g)) for _ in range(STEPS)]
    return GradBufferNet, batches, lambda out, t: F.mse_loss(out, t)


CASES = {name[5:]: fn for name, fn in globals().copy().items() if name.startswith("case_")}


@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_training_equals_single_device(case, replicas):
    make_model, batches, loss_fn = CASES[case]()
    assert_same_training(make_model, lambda m: DataParallel(m, device_ids=["cpu"] * replicas), batches, loss_fn)


def test_training_equals_single_device_through_parameter_copies():
    # the cross-device path (params copied with .to(), gradients sent back) exercised on one CPU
    make_model, batches, loss_fn = case_simplenet()

    def wrap(m):
        dp = DataParallel(m, device_ids=["cpu"] * 3)
        dp._replicator.share_same_device = False
        return dp

    assert_same_training(make_model, wrap, batches, loss_fn)


def test_buffer_that_requires_grad_gets_the_same_gradient():
    _, batches, loss_fn = case_grad_buffer()
    torch.manual_seed(0)
    plain = GradBufferNet()
    wrapped = copy.deepcopy(plain)
    dp = DataParallel(wrapped, device_ids=["cpu"] * 3)
    (args, _, target) = batches[0]
    loss_fn(plain(*args), target).backward()
    loss_fn(dp(*args), target).backward()
    assert wrapped.temperature.grad is not None
    torch.testing.assert_close(wrapped.temperature.grad, plain.temperature.grad)


@pytest.mark.parametrize("replicas", [2, 3])
def test_gradient_penalty_double_backward(replicas):
    torch.manual_seed(0)
    plain = TanhNet()
    wrapped = copy.deepcopy(plain)
    dp = DataParallel(wrapped, device_ids=["cpu"] * replicas)
    opt_a = torch.optim.SGD(plain.parameters(), lr=0.05)
    opt_b = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    g = _gen()
    for _ in range(STEPS):
        x = torch.randn(BATCH, 4, generator=g)
        results = []
        for model, opt in ((plain, opt_a), (dp, opt_b)):
            opt.zero_grad()
            xi = x.clone().requires_grad_(True)
            out = model(xi)
            (grad_x,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
            loss = out.pow(2).mean() + (grad_x.norm(dim=1) - 1).pow(2).mean()
            loss.backward()
            results.append(grads_of(model.module if isinstance(model, DataParallel) else model))
            opt.step()
        assert_close_lists(results[0], results[1])
    assert_close_lists(list(plain.parameters()), list(wrapped.parameters()))


def test_batchnorm_running_mean_is_the_whole_batch_mean():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=0.3))
    wrapped = copy.deepcopy(plain)
    dp = DataParallel(wrapped, device_ids=["cpu"] * 3)
    g = _gen()
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(BATCH, 4, generator=g) * 2 + 1
            plain(x)
            dp(x)
    bn_a, bn_b = plain[1], wrapped[1]
    torch.testing.assert_close(bn_b.running_mean, bn_a.running_mean)
    assert bn_b.num_batches_tracked.item() == 3
    # the running variance is the mean of per-replica variances: close to, not equal to, the whole batch's
    torch.testing.assert_close(bn_b.running_var, bn_a.running_var, atol=0.5, rtol=0.3)


def test_batchnorm_first_mode_keeps_replica_zero_like_torch():
    x = torch.randn(9, 4)
    model = nn.BatchNorm1d(4)
    expected = copy.deepcopy(model)
    expected(x[:3])
    DataParallel(model, device_ids=["cpu"] * 3, buffers="first")(x)
    torch.testing.assert_close(model.running_mean, expected.running_mean)


def test_eval_mode_reaches_replicas():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.9))
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    x = torch.randn(6, 4)
    dp.eval()
    torch.testing.assert_close(dp(x), model(x))


def test_small_batches_use_fewer_devices_and_explicit_chunks_skip_devices():
    torch.manual_seed(0)
    model = SimpleNet()
    x = torch.randn(2, 784)
    seen = []
    model.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    out = DataParallel(model, device_ids=["cpu"] * 4)(x)
    assert sorted(seen) == [1, 1]
    torch.testing.assert_close(out, model(x))
    seen.clear()
    x = torch.randn(10, 784)
    out = DataParallel(model, device_ids=["cpu"] * 3, chunk_sizes=[0, 4, 6])(x)
    assert sorted(seen[:2]) == [4, 6]
    torch.testing.assert_close(out, model(x))


def test_one_device_calls_the_module_directly():
    model = SimpleNet()
    dp = DataParallel(model, device_ids=["cpu"])
    x = torch.randn(5, 784)
    torch.testing.assert_close(dp(x), model(x))
    assert dp._pool.size == 0  # no threads


def test_no_gpu_and_no_devices_runs_the_module_as_is():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without GPUs")
    model = SimpleNet()
    dp = DataParallel(model)
    assert dp.device_ids == [] and dp.output_device is None
    x = torch.randn(3, 784)
    torch.testing.assert_close(dp(x), model(x))


def test_output_device_minus_one_means_cpu():
    dp = DataParallel(SimpleNet(), device_ids=["cpu", "cpu"], output_device=-1)
    assert dp.output_device == torch.device("cpu")


def test_state_dict_has_module_prefix_and_module_is_the_model():
    model = SimpleNet()
    dp = DataParallel(model, device_ids=["cpu"] * 2)
    assert dp.module is model
    keys = list(dp.state_dict())
    assert keys == ["module." + k for k in model.state_dict()]
    fresh = DataParallel(SimpleNet(), device_ids=["cpu"] * 2)
    fresh.load_state_dict(dp.state_dict())
    x = torch.randn(4, 784)
    torch.testing.assert_close(fresh(x), dp(x))


def test_replicas_and_threads_are_reused_across_calls():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 3)
    x = torch.randn(9, 784)
    for _ in range(4):
        dp(x).sum().backward()
    assert dp._replicator._builds == 1
    assert dp._pool.size == 3


def test_no_reference_cycles_after_forward_and_backward():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 3)
    x = torch.randn(9, 784)
    dp(x).sum().backward()  # warm up: threads, replicas
    gc.collect()
    gc.disable()
    try:
        out = dp(x)
        out.sum().backward()
        del out
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_copy_and_pickle_rebuild_the_runtime():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 2)
    x = torch.randn(4, 784)
    expected = dp(x)
    for clone in (copy.deepcopy(dp), pickle.loads(pickle.dumps(dp))):
        torch.testing.assert_close(clone(x), expected)
        clone.close()


def test_close_stops_threads_and_is_idempotent():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 2)
    dp(torch.randn(4, 784))
    dp.close()
    dp.close()
    assert dp._pool.size == 0


# -- bad input: a clear exception, never a hang or a wrong answer ----------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device_ids": []}, DeviceError, "device_ids is empty"),
        ({"device_ids": ["banana"]}, DeviceError, r"'banana' is not a device"),
        ({"device_ids": "cpu"}, DeviceError, "must be a list"),
        ({"device_ids": [1.5]}, DeviceError, "must be an int, a string"),
        ({"device_ids": ["cpu"], "output_device": "banana"}, DeviceError, "output_device 'banana'"),
        ({"device_ids": ["cpu", "cpu"], "chunk_sizes": [3]}, ConfigError, "chunk_sizes has 1 entries"),
        ({"device_ids": ["cpu"], "buffers": "max"}, ConfigError, "buffers must be one of"),
        ({"device_ids": ["cpu"], "dim": "0"}, ConfigError, "dim must be an int"),
    ],
)
def test_construction_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        DataParallel(SimpleNet(), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
@pytest.mark.parametrize("spec", [["cuda:0", "cuda:1"], [0, 1], ["cuda"]])
def test_gpu_devices_without_gpu(spec):
    with pytest.raises(DeviceError, match="no CUDA device is visible"):
        DataParallel(SimpleNet(), device_ids=spec)
    with pytest.raises(DeviceError, match="output_device"):
        DataParallel(SimpleNet(), device_ids=["cpu"], output_device="cuda:3")


def test_not_a_module():
    with pytest.raises(ConfigError, match=r"wraps an nn\.Module"):
        DataParallel(lambda x: x, device_ids=["cpu"])  # type: ignore[arg-type]


def test_module_on_the_wrong_device_names_both_devices():
    dp = DataParallel(SimpleNet().to("meta"), device_ids=["cpu", "cpu"])
    with pytest.raises(DeviceError, match=r"device_ids\[0\] = cpu, but parameter 'fc1.weight' is on meta"):
        dp(torch.randn(4, 784))


def test_inputs_that_disagree_on_batch_size():
    dp = DataParallel(KeywordOnlyNet(), device_ids=["cpu"] * 2)
    with pytest.raises(ScatterError, match=r"args\[0\]: 6, kwargs\['scale'\]: 5"):
        dp(torch.randn(6, 4), scale=torch.ones(5, 1))


def test_empty_batch():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 2)
    with pytest.raises(ScatterError, match="empty"):
        dp(torch.randn(0, 784))


def test_chunk_sizes_that_do_not_sum_to_the_batch():
    dp = DataParallel(SimpleNet(), device_ids=["cpu"] * 2, chunk_sizes=[4, 4])
    with pytest.raises(ScatterError, match="sum to 8 but the batch has 7"):
        dp(torch.randn(7, 784))


class ShapeShifter(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x):
        n = x.shape[0]
        if self.how == "structure":
            return {"a": x} if n % 2 else {"b": x}
        return x.new_zeros(n, n)  # width depends on the replica's share


@pytest.mark.parametrize("how, match", [("structure", "different structures"), ("shape", "shapes")])
def test_outputs_that_cannot_be_gathered(how, match):
    dp = DataParallel(ShapeShifter(how), device_ids=["cpu"] * 2)
    with pytest.raises(GatherError, match=match):
        dp(torch.randn(5, 3))


def test_lazy_module_is_refused():
    dp = DataParallel(nn.Sequential(nn.LazyLinear(3)), device_ids=["cpu"] * 2)
    with pytest.raises(ConfigError, match="uninitialized"):
        dp(torch.randn(4, 5))


def test_errors_inside_replicas_name_replica_and_device():
    class Fails(nn.Module):
        def forward(self, x):
            if x.shape[0] == 2:
                raise ValueError("replica saw two samples")
            return x

    dp = DataParallel(Fails(), device_ids=["cpu"] * 3)
    with pytest.raises(ValueError, match=r"replica 2 on device cpu") as info:
        dp(torch.randn(8, 2))  # [3, 3, 2]
    assert "replica saw two samples" in str(info.value)


def test_a_profiler_trace_names_each_phase_of_the_pipeline():
    model = DataParallel(nn.Linear(4, 2), device_ids=["cpu", "cpu"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(torch.randn(6, 4)).sum().backward()
    names = {event.name for event in prof.events()}
    for stage in ("scatter", "replicate", "parallel_apply", "gather"):
        assert f"paratrain::DataParallel.{stage}" in names, sorted(n for n in names if "paratrain" in n)
    model.close()


# -- torch's test_data_parallel.py behaviours that are not GPU-specific, on CPU replicas ----------------------------


def test_several_inputs_with_gradients_a_float_and_a_keyword_like_torch():
    """torch's test_data_parallel_multiple_input: inputs that require grad get the single-device gradient."""

    class Combine(nn.Module):
        def forward(self, a, b, scale, c=None):
            return scale * (a * b if c is None else a * b + c)

    g = torch.Generator().manual_seed(3)
    a, b, c = (torch.randn(5, 5, generator=g) for _ in range(3))
    for kwargs in ({}, {"c": c}):
        expected_inputs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        expected = Combine()(*expected_inputs, 0.7, **kwargs)
        expected.sum().backward()
        inputs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
        out = DataParallel(Combine(), device_ids=["cpu"] * 2)(*inputs, 0.7, **kwargs)
        out.sum().backward()
        torch.testing.assert_close(out, expected)
        assert_close_lists([t.grad for t in inputs], [t.grad for t in expected_inputs])


@pytest.mark.parametrize("unused", [[], {}, ()], ids=["list", "dict", "tuple"])
def test_keyword_only_input_holding_empty_containers(unused):
    """torch's test_data_parallel_module_kwargs_only_empty_*: empty containers beside the batch are fine."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(10, 5)

        def forward(self, input):
            return self.layer(input["data"])

    net = Net()
    x = torch.randn(20, 10)
    out = DataParallel(net, device_ids=["cpu"] * 2)(input={"data": x, "unused": unused})
    torch.testing.assert_close(out, net.layer(x))


def test_nested_inputs_and_outputs_keep_their_types():
    """torch's test_data_parallel_nested_input and _nested_output."""
    from collections import OrderedDict

    class Net(nn.Module):
        def forward(self, *inputs):
            x = inputs[1][0]
            return [x, (x.sin(), x.cos(), [x.add(1)]), x, OrderedDict(a=x, b=[x.sin()])]

    x = torch.randn(20, 3)
    inputs = (x.cos(), (x, x.sin()), x.sin())
    out = DataParallel(Net(), device_ids=["cpu"] * 3)(*inputs)
    expected = Net()(*inputs)
    assert type(out) is list and type(out[1]) is tuple and type(out[1][2]) is list
    assert type(out[3]) is OrderedDict and list(out[3]) == ["a", "b"] and type(out[3]["b"]) is list
    assert_close_lists(
        [out[0], *out[1][:2], out[1][2][0], out[2], out[3]["a"], out[3]["b"][0]],
        [expected[0], *expected[1][:2], expected[1][2][0], expected[2], expected[3]["a"], expected[3]["b"][0]],
    )


def test_replicas_run_with_gradients_off_under_no_grad():
    """torch's test_data_parallel_no_grad: the replicas' forward sees the caller's grad mode."""
    seen = []

    class Layer(nn.Module):
        def forward(self, x):
            seen.append(torch.is_grad_enabled())
            return x

    dp = DataParallel(Layer(), device_ids=["cpu"] * 2)
    with torch.no_grad():
        dp(torch.randn(4, 2))
    dp(torch.randn(4, 2))
    assert seen == [False, False, True, True]


def test_zero_grad_inside_a_replica_warns_that_it_does_nothing():
    """torch's test_zero_grad: a replica has no gradients of its own to clear."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(3, 3)

        def forward(self, x):
            self.zero_grad()
            return self.layer(x)

    with pytest.warns(UserWarning, match=r"zero_grad\(\) from a module created with nn\.DataParallel"):
        DataParallel(Net(), device_ids=["cpu"] * 2)(torch.randn(4, 3))


def test_channels_last_parameters_get_gradients_in_their_layout():
    """torch's test_strided_grad_layout, on the CPU: each gradient has its parameter's memory format."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(4, 8, 2), nn.Conv2d(8, 4, 2)).to(memory_format=torch.channels_last)
    plain = copy.deepcopy(net)
    x, target = torch.randn(6, 4, 6, 6), torch.randn(6, 4, 4, 4)
    F.mse_loss(plain(x), target).backward()
    F.mse_loss(DataParallel(net, device_ids=["cpu"] * 3)(x), target).backward()
    for p, q in zip(net.parameters(), plain.parameters(), strict=True):
        if p.dim() == 4:
            assert p.grad.is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4)
