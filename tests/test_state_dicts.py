"""Checking a saved state_dict against a model before loading it; which of its keys name which parameter."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from paratrain.checkpoint.state_dicts import check_compatible, parameter_keys, strip_module_prefix
from paratrain.errors import CheckpointError


def make_model(hidden: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(4, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2))


def test_same_model_is_compatible() -> None:
    check_compatible(make_model().state_dict(), make_model().state_dict())


def test_different_shapes_name_the_key_and_both_shapes() -> None:
    with pytest.raises(CheckpointError, match=r"'0\.weight' has shape \(16, 4\) in the checkpoint but \(8, 4\)"):
        check_compatible(make_model(8).state_dict(), make_model(16).state_dict())


def test_different_keys_are_listed() -> None:
    other = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(
        CheckpointError, match=r"missing from the checkpoint: \['1\.weight'.*not in this model: \['2\.weight'"
    ):
        check_compatible(make_model().state_dict(), other.state_dict())


def test_long_key_lists_are_shortened() -> None:
    expected = {f"layer{i}": torch.zeros(1) for i in range(20)}
    with pytest.raises(CheckpointError, match=r"20 key\(s\).*15 more") as info:
        check_compatible(expected, {})
    assert "layer19" not in str(info.value)


def test_different_dtype_names_the_key() -> None:
    with pytest.raises(CheckpointError, match=r"'w' has dtype torch\.float16 in the checkpoint but torch\.float32"):
        check_compatible({"w": torch.zeros(2)}, {"w": torch.zeros(2, dtype=torch.float16)}, what="optimizer")


def test_module_prefix_from_a_wrapped_model_is_accepted() -> None:
    model = make_model()
    wrapped = {f"module.{key}": value for key, value in model.state_dict().items()}
    check_compatible(model.state_dict(), wrapped)
    check_compatible(wrapped, model.state_dict())
    make_model().load_state_dict(strip_module_prefix(wrapped))


def test_strip_module_prefix_is_all_or_nothing() -> None:
    assert strip_module_prefix({"module.a": 1, "module.b": 2}) == {"a": 1, "b": 2}
    assert strip_module_prefix({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}
    assert strip_module_prefix(OrderedDict()) == {}


# --- writable directory -------------------------------------------------------------------------------------------


class _Tied(nn.Module):
    """A language model's shape: the output head shares the embedding's weight; a block used twice; a frozen bias."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)
        self.again = self.block  # the same module under a second name: both its parameters tied
        self.head = nn.Linear(4, 10)
        self.head.weight = self.embed.weight
        self.head.bias.requires_grad_(False)
        self.register_buffer("scale", torch.ones(4))


def test_parameter_keys_name_every_key_of_a_parameter_and_resolve_tied_ones_to_the_first() -> None:
    model = _Tied()
    trained = [p for p in model.parameters() if p.requires_grad]
    keys = parameter_keys(model, trained)
    assert {key: first for key, (first, _) in keys.items()} == {
        "embed.weight": "embed.weight",
        "block.weight": "block.weight",
        "block.bias": "block.bias",
        "again.weight": "block.weight",
        "again.bias": "block.bias",
        "head.weight": "embed.weight",
    }
    assert keys["head.weight"][1] is model.embed.weight and keys["again.bias"][1] is model.block.bias
    assert set(keys) <= set(model.state_dict())  # the keys are the state dict's: buffers and the frozen bias left out
    assert parameter_keys(model, []) == {}
