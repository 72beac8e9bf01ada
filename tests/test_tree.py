from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from paratrain.tree import flatten, leaf_paths, unflatten

Pair = namedtuple("Pair", ["left", "right"])


@dataclass
class Batch:
    x: torch.Tensor
    label: str
    extra: list = field(default_factory=list)


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor
    n: int = field(init=False, default=0)


class MyDict(dict):
    pass


def _roundtrip(obj):
    leaves, spec = flatten(obj)
    return leaves, spec, unflatten(leaves, spec)


@pytest.mark.parametrize(
    "obj, n_leaves",
    [
        (torch.ones(2), 1),
        ((1, 2, (3, 4)), 4),
        ([1, [2, 3]], 3),
        ({"a": 1, "b": {"c": 2}}, 2),
        (Pair(1, Pair(2, 3)), 3),
        (None, 1),
        ("text", 1),
        (torch.Size([2, 3]), 1),  # a tuple subclass that is a value, not a container
        ((), 0),
    ],
)
def test_roundtrip_keeps_structure(obj, n_leaves):
    leaves, _, back = _roundtrip(obj)
    assert len(leaves) == n_leaves
    assert type(back) is type(obj)
    if isinstance(obj, torch.Tensor):
        assert back is obj
    else:
        assert back == obj


def test_dict_subclasses_keep_their_type_and_order():
    od = OrderedDict([("z", 1), ("a", 2)])
    dd = defaultdict(list, {"k": 3})
    md = MyDict(q=4)
    _, _, back = _roundtrip((od, dd, md))
    assert type(back[0]) is OrderedDict and list(back[0]) == ["z", "a"]
    assert type(back[1]) is defaultdict and back[1].default_factory is list and back[1]["k"] == 3
    assert type(back[2]) is MyDict and back[2] == {"q": 4}


def test_dataclasses_rebuild_including_fields_outside_init():
    b = Batch(torch.zeros(2), "x", [1])
    _leaves, _spec, back = _roundtrip(b)
    assert isinstance(back, Batch) and back.label == "x" and back.extra == [1]
    f = Frozen(torch.ones(1))
    object.__setattr__(f, "n", 7)
    _, _, fb = _roundtrip(f)
    assert fb.n == 7


def test_specs_compare_structures():
    assert flatten({"a": 1})[1] == flatten({"a": 2})[1]
    assert flatten({"a": 1})[1] != flatten({"b": 1})[1]
    assert flatten((1, 2))[1] != flatten([1, 2])[1]
    assert flatten(Pair(1, 2))[1] != flatten((1, 2))[1]


def test_leaf_paths_are_readable():
    _, spec = flatten(((1, {"mask": 2}), Batch(torch.zeros(1), "a")))
    assert leaf_paths(spec) == ["[0][0]", "[0][1]['mask']", "[1].x", "[1].label"]  # extra=[] has no leaves


def test_unflatten_checks_leaf_count():
    _, spec = flatten((1, 2))
    with pytest.raises(ValueError, match="2 leaves but 3"):
        unflatten([1, 2, 3], spec)
