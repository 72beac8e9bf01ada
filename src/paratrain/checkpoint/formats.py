"""A model's state dict as a safetensors file: ``paratrain checkpoint consolidate --format safetensors``.

    tensors, notes = safetensors_tensors(model_state)    # every key a tensor of its own, contiguous
    write_safetensors(model_state, "model.safetensors")  # atomically; the notes say what was copied
    model.load_state_dict(safetensors.torch.load_file("model.safetensors"))   # strict

safetensors stores named tensors only, each in bytes of its own: a weight two modules share (tied) is written
under each of its names (the later ones as copies, which a strict ``load_state_dict`` takes: both keys fill the
one parameter), a non-contiguous tensor as a contiguous copy, and a state holding anything but tensors (a
module's ``_extra_state``) is refused, naming the keys. The package is an optional extra
(``pip install 'paratrain[safetensors]'``); without it :func:`require_safetensors` says so in one line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.state_dicts import describe_keys
from paratrain.errors import CheckpointError, ConfigError
from paratrain.files import atomic_writer

__all__ = ["FORMATS", "require_safetensors", "safetensors_tensors", "write_safetensors"]

FORMATS = ("torch", "safetensors")
_INSTALL = "pip install 'paratrain[safetensors]'"


def require_safetensors(flag: str = "--format safetensors") -> None:
    """Raise ConfigError (one line, naming the install) when the safetensors package cannot be imported."""
    if importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"{flag} needs the safetensors package, which is not installed: {_INSTALL}")


def safetensors_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``state``'s tensors as safetensors takes them (each contiguous, none sharing memory with another), on the
    CPU, in ``state``'s order; and a note for each key written as a copy.

    Raises:
        ConfigError: keys whose values are not tensors (each named), or that are not strings.
    """
    not_named = [key for key in state if not isinstance(key, str)]
    if not_named:
        raise ConfigError(f"safetensors names tensors by strings; the state has keys {describe_keys(not_named)}")
    others = [key for key, value in state.items() if not isinstance(value, torch.Tensor)]
    if others:
        kinds = sorted({type(state[key]).__name__ for key in others})
        raise ConfigError(
            f"safetensors stores tensors only, and the model state has {len(others)} other value(s) "
            f"({', '.join(kinds)}) under {describe_keys(others)} (a module's _extra_state, say): write it with "
            f"--format torch, which keeps them"
        )
    tensors: dict[str, torch.Tensor] = {}
    notes: list[str] = []
    owners: dict[tuple[str, int], tuple[str, torch.Tensor]] = {}  # a storage -> the first key (and tensor) in it
    for key, value in state.items():
        tensor = value.detach().cpu()
        storage = (str(value.device), value.untyped_storage().data_ptr())
        first = owners.get(storage) if value.numel() > 0 else None
        if first is not None:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            name, other = first
            tied = other.data_ptr() == value.data_ptr() and other.shape == value.shape
            notes.append(
                f"{key} is the same tensor as {name} (a tied weight): written as a copy, which a strict "
                f"load_state_dict takes (both names fill the one parameter)"
                if tied
                else f"{key} shares memory with {name} (views of one buffer): written as a copy of its own"
            )
        elif not tensor.is_contiguous():
            tensor = tensor.contiguous()
            notes.append(f"{key} is not contiguous in memory: written as a contiguous copy (the same values)")
        if value.numel() > 0:
            owners.setdefault(storage, (key, value))
        tensors[key] = tensor
    return tensors, notes


def write_safetensors(state: Mapping[str, Any], out: str | Path) -> list[str]:
    """Write ``state`` (a model's state dict) to ``out`` as safetensors, atomically; the notes of
    :func:`safetensors_tensors`.

    Raises:
        ConfigError: the package is missing, or ``state`` holds what safetensors cannot store.
        CheckpointError: safetensors refused a tensor (a dtype it does not know).
    """
    require_safetensors()
    from safetensors.torch import save

    tensors, notes = safetensors_tensors(state)
    try:
        data = save(tensors, metadata={"format": "pt"})  # "pt": what transformers' loaders look for
    except (ValueError, TypeError, KeyError) as exc:  # torch.complex64, say, which it has no name for
        raise CheckpointError(f"safetensors cannot store this state: {exc}") from exc
    with atomic_writer(Path(out), "wb", durable=True) as stream:
        stream.write(data)
    return notes
