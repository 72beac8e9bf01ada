"""Checking a saved state_dict against a model before loading it."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from paratrain.checkpoint.state_dicts import check_compatible, strip_module_prefix
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
