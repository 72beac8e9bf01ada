"""build_model_spec: built-in names and module.path:callable, and the errors a user can cause."""

from __future__ import annotations

import pytest
from torch import nn

from paratrain.errors import ConfigError
from paratrain.training.model_spec import build_model_spec
from paratrain.training.models import MLP, SimpleNet


def _build(spec: str, shape=(6,), classes=3) -> nn.Module:
    return build_model_spec(spec, shape, classes, width=8, depth=1)


def test_builtin_names_delegate_to_build_model():
    assert isinstance(build_model_spec("simplenet", (1, 28, 28), 10, width=8, depth=1), SimpleNet)
    mlp = _build("mlp")
    assert isinstance(mlp, MLP) and mlp.net[1].out_features == 8


def test_callable_with_two_arguments_gets_shape_and_classes():
    model = _build("verify_models:clean_net", shape=(2, 3), classes=4)
    assert model[1].in_features == 6 and model[-1].out_features == 4


def test_callable_without_arguments_is_called_bare():
    assert isinstance(_build("verify_models:no_arguments"), nn.Linear)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("resnet", "unknown model 'resnet'"),
        ("no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
        ("verify_models:missing", "has no attribute 'missing'"),
        ("verify_models:_UNSEEDED", "not a callable"),
        ("verify_models:raises", r"raised RuntimeError: cannot build this one"),
        ("verify_models:not_a_module", "returned a str, not a torch.nn.Module"),
        ("verify_models:", "expected module.path:callable"),
    ],
)
def test_bad_specs_say_what_was_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        _build(spec)
