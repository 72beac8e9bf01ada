"""A model given the way the command line gives it: a built-in name, or ``module.path:callable``.

    build_model_spec("simplenet", (1, 28, 28), 10, width=1024, depth=2)      # training.models.build_model
    build_model_spec("mypkg.nets:make_net", (3, 32, 32), 10, width=0, depth=0)

A ``module.path:callable`` is imported and called as ``callable(input_shape, num_classes)`` when it takes two
positional arguments, else as ``callable()`` (a class or a factory with no arguments); it must return an
``nn.Module``. ``width`` and ``depth`` only shape the built-in ``mlp``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ..errors import ConfigError
from .models import MODEL_NAMES, build_model

__all__ = ["MODEL_SPEC_HELP", "build_model_spec", "is_builtin_model"]

MODEL_SPEC_HELP = (
    f"a built-in model ({', '.join(MODEL_NAMES)}) or module.path:callable, called as callable(input_shape, "
    "num_classes) when it takes two arguments, else as callable(); it must return an nn.Module"
)


def is_builtin_model(spec: str) -> bool:
    return spec in MODEL_NAMES


def build_model_spec(spec: str, input_shape: tuple[int, ...], num_classes: int, *, width: int, depth: int) -> nn.Module:
    """The model ``spec`` names, for samples of ``input_shape`` and ``num_classes`` classes.

    Raises:
        ConfigError: an unknown name, a path that does not import, a callable that raises (its message is
            included), or one that does not return an ``nn.Module``.
    """
    if ":" not in spec:
        if spec not in MODEL_NAMES:
            raise ConfigError(
                f"unknown model {spec!r}; choose one of: {', '.join(MODEL_NAMES)}, or give module.path:callable"
            )
        return build_model(spec, input_shape, num_classes, width=width, depth=depth)
    factory = _resolve(spec)
    two_args = _takes_two_arguments(factory)
    try:
        model = factory(tuple(input_shape), num_classes) if two_args else factory()
    except Exception as exc:
        called = f"{spec}({tuple(input_shape)}, {num_classes})" if two_args else f"{spec}()"
        raise ConfigError(f"model {called} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model {spec} returned a {type(model).__name__}; expected a torch.nn.Module: return the model itself"
        )
    return model


def _resolve(spec: str) -> Callable[..., Any]:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"model {spec!r}: expected module.path:callable such as mypkg.nets:make_model")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"model {spec!r}: cannot import module {module_name!r} ({exc}); check the name, and that it is on "
            f"PYTHONPATH (the current directory is not searched when paratrain runs as a command)"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"model {spec!r}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"model {spec!r}: {attribute!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]


def _takes_two_arguments(factory: Callable[..., Any]) -> bool:
    """True when ``factory(input_shape, num_classes)`` binds; False when only ``factory()`` does."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have no signature: try the two-argument form
        return True
    try:
        signature.bind((1,), 1)
    except TypeError:
        return False
    return True
