"""Which model key each parameter of a saved optimizer state is: its indices as fully qualified names (FQNs).

    names = optimizer_fqns(state["model"], state["optimizer"])     # ["fc1.weight", "fc1.bias", ...], index order
    by_name = optimizer_state_by_name(state["optimizer"], names)   # as torch's get_optimizer_state_dict lays it out

A checkpoint holds torch's ``optimizer.state_dict()`` (paratrain's sharded ones too: the state a single process
saves), which numbers the parameters 0, 1, ... in the order of its groups. The names come from the groups'
``param_names`` when the optimizer was built over ``model.named_parameters()`` (torch records them then); from
the checkpoint's ``parameter_names`` (``paratrain train`` records its model's, in the order of its optimizer's
indices); else the parameters are taken to be the model's, in ``model.parameters()`` order (as
``AdamW(model.parameters())`` has them): the state dict lists them in that order among the buffers, a tied weight
under its first name only. Which keys are buffers the state does not say, so each parameter's place is found by the
shape of its state (``exp_avg``, ``momentum_buffer``): the places must be the only ones that fit, else
:class:`~paratrain.errors.CheckpointError` names the first parameter that could be two keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from paratrain.errors import CheckpointError

__all__ = ["optimizer_fqns", "optimizer_state_by_name"]

_ASSUMED = (
    "its parameters were taken to be the model's in model.parameters() order, as paratrain train builds it (an "
    "optimizer of other groups or order records its names when built over model.named_parameters())"
)


def optimizer_fqns(
    model: Mapping[str, Any], optimizer: Mapping[str, Any], recorded: Sequence[str] | None = None
) -> list[str]:
    """The model key of each parameter of ``optimizer`` (a saved state dict), in the order of its indices;
    ``recorded``: the names a checkpoint records for them (its ``parameter_names``), if any.

    Raises:
        CheckpointError: the state's shapes do not place every parameter on exactly one key of ``model``.
    """
    groups = optimizer.get("param_groups")
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        raise CheckpointError("the optimizer state has no param_groups with params: it is not torch's state_dict()")
    indices = [index for group in groups for index in group["params"]]
    named: list[str] | None = None
    if all("param_names" in g and len(g["param_names"]) == len(g["params"]) for g in groups):
        named = [str(name) for g in groups for name in g["param_names"]]
    elif recorded is not None and len(recorded) == len(indices):
        named = [str(name) for name in recorded]
    if named is not None:
        unknown = [name for name in named if name not in model]
        if unknown:
            raise CheckpointError(
                f"the optimizer's parameter names {unknown[:3]} are not keys of the model state: its optimizer "
                f"was built over another module's parameters"
            )
        return named
    keys = _candidate_keys(model)
    state = optimizer.get("state", {})
    shapes = [_state_shape(state.get(index), index) for index in indices]

    def fits(i: int, key: str) -> bool:
        return shapes[i] is None or shapes[i] == tuple(model[key].shape)

    first = _embed(len(indices), keys, fits)
    if first is None:
        raise CheckpointError(
            f"the optimizer's {len(indices)} parameters do not fit the model's tensors in order: {_ASSUMED}. "
            f"Export the model alone (--model-only)"
        )
    last = _embed_from_the_end(len(indices), keys, fits)
    assert last is not None  # an embedding exists, so one from the end does too
    for i, (a, b) in enumerate(zip(first, last, strict=True)):
        if a != b:
            shape = "no state" if shapes[i] is None else f"state of shape {shapes[i]}"
            raise CheckpointError(
                f"the optimizer's parameter {indices[i]} ({shape}) could be the model's {keys[a]!r} or "
                f"{keys[b]!r}: the checkpoint does not say which keys are parameters, and {_ASSUMED}. Export the "
                f"model alone (--model-only)"
            )
    return [keys[at] for at in first]


def _candidate_keys(model: Mapping[str, Any]) -> list[str]:
    """The keys that may be parameters: floating tensors, a tensor under several keys (tied) at its first only."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    keys = []
    for key, value in model.items():
        if not isinstance(value, torch.Tensor) or not (value.is_floating_point() or value.is_complex()):
            continue
        identity = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
        if value.numel() and identity in seen:
            continue
        seen.add(identity)
        keys.append(str(key))
    return keys


def _state_shape(entry: Any, index: Any) -> tuple[int, ...] | None:
    """The parameter's shape as its state shows it (any tensor but the step count), None when it shows none."""
    if not isinstance(entry, Mapping):
        return None
    shapes = {tuple(v.shape) for k, v in entry.items() if isinstance(v, torch.Tensor) and k != "step"}
    if len(shapes) > 1:
        raise CheckpointError(f"the optimizer state of parameter {index} holds tensors of shapes {sorted(shapes)}")
    return shapes.pop() if shapes else None


def _embed(count: int, keys: Sequence[str], fits: Callable[[int, str], bool]) -> list[int] | None:
    """The earliest places of parameters 0..count-1 on ``keys`` in order (each after the last), or None."""
    places, at = [], 0
    for i in range(count):
        while at < len(keys) and not fits(i, keys[at]):
            at += 1
        if at == len(keys):
            return None
        places.append(at)
        at += 1
    return places


def _embed_from_the_end(count: int, keys: Sequence[str], fits: Callable[[int, str], bool]) -> list[int] | None:
    """The latest such places; equal to the earliest ones exactly when no other placing fits."""
    places, at = [], len(keys) - 1
    for i in reversed(range(count)):
        while at >= 0 and not fits(i, keys[at]):
            at -= 1
        if at < 0:
            return None
        places.append(at)
        at -= 1
    return places[::-1]


def optimizer_state_by_name(optimizer: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``optimizer`` (a saved state dict) keyed by ``names`` (one per index, in index order), as torch's
    ``get_optimizer_state_dict`` gives it: ``state`` by name, and each group's ``params`` a list of names."""
    groups = optimizer["param_groups"]
    indices = [index for group in groups for index in group["params"]]
    name_of = dict(zip(indices, names, strict=True))
    state = {name_of[index]: dict(value) for index, value in optimizer.get("state", {}).items() if index in name_of}
    by_name = []
    for group in groups:
        entry = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        entry["params"] = [name_of[index] for index in group["params"]]
        by_name.append(entry)
    return {"state": state, "param_groups": by_name}
