from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from paratrain.dp.scatter_gather import check_chunk_sizes, gather, scatter, split_sizes
from paratrain.errors import ConfigError, GatherError, ScatterError

CPU = torch.device("cpu")
Out = namedtuple("Out", ["logits", "aux"])


@dataclass
class Sample:
    x: torch.Tensor
    tag: str


@pytest.mark.parametrize(
    "batch, devices, expected",
    [
        (30, 2, [15, 15]),
        (30, 3, [10, 10, 10]),
        (30, 4, [8, 8, 7, 7]),
        (6, 4, [2, 2, 1, 1]),  # torch.chunk would give [2, 2, 2] and leave a device idle
        (3, 4, [1, 1, 1]),  # fewer samples than devices: that many devices
        (1, 3, [1]),
        (64, 3, [22, 21, 21]),
        (7, 1, [7]),
    ],
)
def test_split_sizes_table(batch, devices, expected):
    sizes = split_sizes(batch, devices)
    assert sizes == expected
    assert sum(sizes) == batch and max(sizes) - min(sizes) <= 1


def test_split_of_empty_batch_is_an_error():
    with pytest.raises(ScatterError, match="empty batch"):
        split_sizes(0, 4)


def test_explicit_chunk_sizes():
    assert check_chunk_sizes([4, 10, 10], 24, 3) == [4, 10, 10]
    assert check_chunk_sizes([0, 12, 12], 24, 3) == [0, 12, 12]
    with pytest.raises(ScatterError, match=r"sum to 20 but the batch has 24"):
        check_chunk_sizes([10, 10], 24, 2)
    with pytest.raises(ConfigError, match="2 entries but there are 3 devices"):
        check_chunk_sizes([12, 12], 24, 3)
    with pytest.raises(ConfigError, match="non-negative"):
        check_chunk_sizes([30, -6], 24, 2)


def test_scatter_splits_every_structure_and_kwargs_alike():
    x = torch.arange(30.0).reshape(10, 3)
    args = (x, [x[:, 0]], OrderedDict(m=x), Sample(x, "s"), "flag", 3)
    kwargs = {"mask": torch.ones(10, 2), "scale": torch.tensor(2.0), "name": "n"}
    shares = scatter(args, kwargs, [CPU] * 3)
    assert [s.size for s in shares] == [4, 3, 3]
    assert [s.slot for s in shares] == [0, 1, 2]
    start = 0
    for share in shares:
        a, k = share.args, share.kwargs
        stop = start + share.size
        assert torch.equal(a[0], x[start:stop])
        assert torch.equal(a[1][0], x[start:stop, 0])
        assert type(a[2]) is OrderedDict and torch.equal(a[2]["m"], x[start:stop])
        assert isinstance(a[3], Sample) and a[3].tag == "s" and torch.equal(a[3].x, x[start:stop])
        assert a[4:] == ("flag", 3)
        assert k["mask"].shape == (share.size, 2)  # kwargs are never dropped
        assert k["scale"].item() == 2.0 and k["name"] == "n"
        start = stop


def test_scatter_with_chunk_sizes_skips_zero_devices():
    shares = scatter((torch.zeros(6, 1),), {}, [CPU] * 3, chunk_sizes=[0, 2, 4])
    assert [(s.slot, s.size) for s in shares] == [(1, 2), (2, 4)]


def test_scatter_along_other_dim():
    x = torch.zeros(2, 9)
    shares = scatter((x,), {}, [CPU] * 2, dim=1)
    assert [s.args[0].shape for s in shares] == [torch.Size([2, 5]), torch.Size([2, 4])]
    shares = scatter((x,), {}, [CPU] * 2, dim=-1)
    assert [s.size for s in shares] == [5, 4]


def test_scatter_without_tensors_runs_once_on_first_device():
    shares = scatter(("a",), {"k": 1}, [CPU] * 3)
    assert len(shares) == 1 and shares[0].args == ("a",) and shares[0].kwargs == {"k": 1}


def test_scatter_errors_name_the_inputs():
    with pytest.raises(ScatterError, match=r"args\[0\]: 10, kwargs\['mask'\]: 5"):
        scatter((torch.zeros(10, 2),), {"mask": torch.zeros(5)}, [CPU] * 2)
    with pytest.raises(ScatterError, match="empty"):
        scatter((torch.zeros(0, 5),), {}, [CPU] * 2)
    with pytest.raises(ScatterError, match=r"args\[0\] of shape \(4,\) along dim 1"):
        scatter((torch.zeros(4),), {}, [CPU] * 2, dim=1)


def test_scatter_and_gather_carry_gradients():
    x = torch.randn(7, 3, requires_grad=True)
    shares = scatter((x,), {}, [CPU] * 3)
    out = gather([s.args[0] * (i + 1) for i, s in enumerate(shares)], CPU)
    out.sum().backward()
    expected = torch.tensor([1.0] * 3 + [2.0] * 2 + [3.0] * 2).unsqueeze(1).expand(7, 3)
    assert torch.equal(x.grad, expected)


def test_gather_keeps_structure_and_concatenates():
    outs = [
        {"out": Out(torch.ones(2, 3) * i, [torch.zeros(2)]), "n": 5, "who": f"r{i}", "none": None} for i in range(3)
    ]
    g = gather(outs, CPU)
    assert isinstance(g["out"], Out)
    assert g["out"].logits.shape == (6, 3)
    assert g["out"].logits[:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    assert g["out"].aux[0].shape == (6,)
    assert g["n"] == 5  # equal values appear once
    assert g["who"] == ["r0", "r1", "r2"]  # different values: a list, one per replica
    assert g["none"] is None


def test_gather_turns_scalars_into_a_vector():
    g = gather([torch.tensor(1.0), torch.tensor(2.0)], CPU)
    assert g.shape == (2,) and g.tolist() == [1.0, 2.0]


def test_gather_single_output_on_device_is_returned_as_is():
    t = torch.ones(3, 2)
    assert gather([t], CPU) is t


def test_gather_of_dataclass_and_tensor_values_with_elementwise_eq():
    outs = [Sample(torch.ones(1, 2), "a"), Sample(torch.ones(2, 2), "a")]
    g = gather(outs, CPU)
    assert g.x.shape == (3, 2) and g.tag == "a"


@pytest.mark.parametrize(
    "outs, match",
    [
        ([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}], "different structures"),
        ([(torch.zeros(1),), [torch.zeros(1)]], "different structures"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], r"shapes \[\(2, 3\), \(2, 4\)\]"),
        ([torch.zeros(2, 3), torch.zeros(2)], "shapes"),
        ([torch.zeros(2), "x"], "tensor on some replicas"),
        ([torch.zeros(2), torch.zeros(2, dtype=torch.int64)], "dtypes"),
    ],
)
def test_gather_errors(outs, match):
    with pytest.raises(GatherError, match=match):
        gather(outs, CPU)
