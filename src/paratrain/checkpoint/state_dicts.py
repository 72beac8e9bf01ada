"""Does a saved state_dict fit this model? Keys, shapes and dtypes, checked before loading; and which keys hold
which parameter.

check_compatible(model.state_dict(), saved["model"])     # CheckpointError naming the first difference
model.load_state_dict(strip_module_prefix(saved["model"]))
parameter_keys(model, model.parameters())                # {"head.weight": ("embed.weight", weight), ...}
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from paratrain.errors import CheckpointError

__all__ = ["check_compatible", "describe_keys", "parameter_keys", "strip_module_prefix"]

_MODULE_PREFIX = "module."
_DIFFERENT_MODEL_HINT = (
    "It was probably saved by a different model or configuration: resume with the settings that wrote it, "
    "or start a fresh run in another checkpoint directory."
)


def strip_module_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Remove the ``module.`` that a ``DataParallel`` / ``DistributedDataParallel`` wrapper adds to every key.

    All or nothing: keys are changed only when every one of them carries the prefix, so a model that merely has
    a submodule called ``module`` is left alone.
    """
    stripped = OrderedDict(state)
    # torch's helper strips every key that has the prefix; the all-or-nothing rule is ours, checked first
    if stripped and all(isinstance(key, str) and key.startswith(_MODULE_PREFIX) for key in stripped):
        consume_prefix_in_state_dict_if_present(stripped, _MODULE_PREFIX)
    return dict(stripped)


def check_compatible(
    model_state: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor], *, what: str = "model"
) -> None:
    """Check that ``saved`` has the keys, shapes and dtypes of ``model_state`` before loading it.

    A ``module.`` prefix on either side (a wrapped model) is ignored; load ``strip_module_prefix(saved)`` into the
    unwrapped model. ``what`` names the thing in messages (``"model"``, ``"EMA model"``, ...).

    Raises:
        CheckpointError: keys are missing or unexpected (a few of each are listed), or the first tensor whose
            shape or dtype differs, with both.
    """
    expected = strip_module_prefix(model_state)
    found = strip_module_prefix(saved)
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(
                f"{len(missing)} key(s) of this {what} are missing from the checkpoint: {describe_keys(missing)}"
            )
        if unexpected:
            problems.append(
                f"{len(unexpected)} key(s) in the checkpoint are not in this {what}: {describe_keys(unexpected)}"
            )
        raise CheckpointError(
            f"the checkpoint does not match this {what}: {'; '.join(problems)}. {_DIFFERENT_MODEL_HINT}"
        )
    for key, want in expected.items():
        got = found[key]
        if _tensor_like(want) != _tensor_like(got):
            raise CheckpointError(
                f"{what} entry {key!r} is a {type(got).__name__} in the checkpoint but a {type(want).__name__} "
                f"in this {what}. {_DIFFERENT_MODEL_HINT}"
            )
        if not _tensor_like(want):
            continue
        if tuple(want.shape) != tuple(got.shape):
            raise CheckpointError(
                f"{what} entry {key!r} has shape {tuple(got.shape)} in the checkpoint but {tuple(want.shape)} "
                f"in this {what}. {_DIFFERENT_MODEL_HINT}"
            )
        if want.dtype != got.dtype:
            raise CheckpointError(
                f"{what} entry {key!r} has dtype {got.dtype} in the checkpoint but {want.dtype} in this {what}. "
                f"{_DIFFERENT_MODEL_HINT}"
            )


def _tensor_like(value: Any) -> bool:
    """A tensor, or a tensor a checkpoint reads on demand (its shape and dtype known, its values not read yet)."""
    return isinstance(value, torch.Tensor) or (
        hasattr(value, "shape") and isinstance(getattr(value, "dtype", None), torch.dtype)
    )


def describe_keys(keys: list[Any], limit: int = 5) -> str:
    """A short list of keys for messages: the first few, then how many more."""
    shown = ", ".join(repr(key) for key in keys[:limit])
    return f"[{shown}]" if len(keys) <= limit else f"[{shown}, ... {len(keys) - limit} more]"


def parameter_keys(module: nn.Module, params: Iterable[torch.Tensor]) -> dict[str, tuple[str, torch.Tensor]]:
    """Every state-dict key of ``module`` that names one of ``params``, with the parameter's first name and the
    parameter: the fully qualified names, as torch's distributed checkpoint matches them.

    A parameter that two modules share (tied weights) has a key under each; both map to its first name (in
    ``named_parameters`` order), under which a checkpoint stores it once. Keys of other parameters and of buffers
    are left out.
    """
    wanted = {id(p) for p in params}
    first: dict[int, str] = {}
    keys: dict[str, tuple[str, torch.Tensor]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in wanted:
            keys[name] = (first.setdefault(id(p), name), p)
    return keys
