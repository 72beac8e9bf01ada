"""``--model``: a built-in model by name, or a user's own as ``module.path:callable``.

    build_model_spec("simplenet", (1, 28, 28), 10, width=1024, depth=2)         # training.models.build_model
    build_model_spec("mynets:small", (1, 28, 28), 10, width=1024, depth=2)      # mynets.small((1, 28, 28), 10)

The callable (a function or a class) is called with ``(input_shape, num_classes)`` when it accepts two positional
arguments, otherwise with none, and must return an ``nn.Module``. The module is imported like any other, with
the current directory on the import path (as ``python -m`` has it), so ``mynets.py`` beside the command works.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from paratrain.errors import ConfigError
from paratrain.training.models import MODEL_NAMES, build_model

__all__ = ["MODEL_SPEC_HELP", "build_model_spec", "check_model_spec", "is_model_spec"]

# the help of every --model flag (train, verify, bench, plan)
MODEL_SPEC_HELP = (
    f"the model: one of {', '.join(MODEL_NAMES)}, or your own as module.path:callable, called with "
    f"(input_shape, num_classes) when it takes two arguments, else with none, returning an nn.Module"
)


def is_model_spec(spec: str) -> bool:
    """True for ``module.path:callable`` (anything with a colon), False for a built-in name."""
    return ":" in spec


def check_model_spec(spec: str, flag: str = "--model", example: str = "mynets:build_model") -> Callable[..., Any]:
    """The callable ``spec`` names, imported but not called (``flag`` names the setting in errors).

    Raises:
        ConfigError: a malformed spec, a module that cannot be imported, a missing or non-callable attribute.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute or ":" in attribute:
        raise ConfigError(f"{flag} {spec}: expected module.path:callable, such as {example}")
    with _cwd_importable():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # anything the user's module raises while importing is a usage problem
            raise ConfigError(
                f"{flag} {spec}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); check the module "
                f"path and that it imports (from {os.getcwd()})"
            ) from exc
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{flag} {spec}: module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{flag} {spec}: {attribute!r} is a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]


def build_model_spec(spec: str, input_shape: tuple[int, ...], num_classes: int, *, width: int, depth: int) -> nn.Module:
    """The model ``spec`` names (see the module docstring); ``width``/``depth`` go to the built-in ``mlp``.

    Raises:
        ConfigError: an unknown name or bad path, a callable that raises (its message included), or one that
            does not return an ``nn.Module``.
    """
    if not is_model_spec(spec):
        return build_model(spec, input_shape, num_classes, width=width, depth=depth)
    factory = check_model_spec(spec)
    args: tuple[Any, ...] = (tuple(input_shape), num_classes) if _takes_two(factory) else ()
    try:
        model = factory(*args)
    except Exception as exc:
        called = f"{spec}({', '.join(map(repr, args))})"
        raise ConfigError(f"--model {spec}: {called} raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _takes_two(factory: Callable[..., Any]) -> bool:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (some builtins): assume the documented two
        return True
    try:
        signature.bind(None, None)
    except TypeError:
        return False
    return True


@contextlib.contextmanager
def _cwd_importable() -> Iterator[None]:
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.append(cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
