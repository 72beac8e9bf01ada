"""A model's weights from the files users have: ``paratrain train --init-from FILE``.

    how = load_weights("model.safetensors", model)       # before par.prepare: "safetensors, 4 tensors"
    load_weights("model.pt", model)                      # a state dict torch.save wrote (or {"model": ...})
    load_weights("dcp/step-4", model)                    # a torch.distributed.checkpoint directory
    load_weights("runs/a", model)                        # paratrain's checkpoints: a file, a sharded directory, a run

Every format is read on the CPU, checked against the model's state dict (keys and shapes: the first that differs
is named, before anything is loaded), and loaded strictly with ``load_state_dict``; a ``module.`` prefix (a DDP
wrapper's) is dropped, and dtypes are converted as ``load_state_dict`` converts them. A DCP directory's keys may
sit under ``model.`` (as ``paratrain checkpoint export`` writes them) or at the top (``dcp.save(model.state_dict())``);
it is read straight into the model's tensors. A torch file is memory-mapped. Under zero3 ``paratrain train``
reads the same formats a tensor at a time into each rank's shards instead (:mod:`paratrain.checkpoint.lazy_weights`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.consolidate import find_checkpoint
from paratrain.checkpoint.dcp_export import is_dcp_checkpoint
from paratrain.checkpoint.file import FORMAT, load_checkpoint
from paratrain.checkpoint.formats import require_safetensors
from paratrain.checkpoint.lazy_weights import FileTensor, existing_weights
from paratrain.checkpoint.sharded import StoredTensor, is_sharded_checkpoint, materialize, open_sharded
from paratrain.checkpoint.state_dicts import describe_keys, strip_module_prefix
from paratrain.errors import CheckpointError, ConfigError

__all__ = ["check_fits_model", "load_weights"]


def load_weights(source: str | Path, model: nn.Module, *, flag: str = "--init-from") -> str:
    """Load the weights at ``source`` into ``model`` (strictly); a few words saying what was read.

    Raises:
        ConfigError: nothing at ``source``; weights that do not fit ``model`` (the first key or shape that
            differs); a safetensors file without the package.
        CheckpointError: a file that cannot be read as any of the formats.
    """
    path = existing_weights(source, flag)
    expected = model.state_dict()
    if is_dcp_checkpoint(path):
        return _load_dcp(path, model, expected, flag)
    if path.suffix == ".safetensors" and path.is_file():
        require_safetensors(f"{flag} {path}")
        from safetensors.torch import load_file

        state: Mapping[str, Any] = load_file(str(path))
        what = "safetensors"
    elif not path.is_file():  # a sharded checkpoint (or the .pt path it was saved to), a run's checkpoint directory
        found, _ = find_checkpoint(path)
        state, what = _paratrain_model(found), f"paratrain checkpoint {found}"
    else:
        state, what = _torch_file(path, flag)
    state = strip_module_prefix(state)
    check_fits_model(expected, state, f"{flag} {path}")
    model.load_state_dict(state)
    tensors = sum(isinstance(value, torch.Tensor) for value in state.values())
    return f"{what}, {tensors} tensors"


def check_fits_model(expected: Mapping[str, Any], found: Mapping[str, Any], what: str) -> None:
    """Raise ConfigError naming the first key of ``expected`` that ``found`` lacks, the first it has beyond
    them, or the first tensor whose shape differs (the dtype may: ``load_state_dict`` converts it)."""
    missing = [key for key in expected if key not in found]
    unexpected = [key for key in found if key not in expected]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(
            f"{what} does not fit the model: it has no {missing[0]!r}{more}; its keys begin "
            f"{describe_keys(list(found), 3)}. Give weights of this model (the same --model, --width, --depth)"
        )
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(
            f"{what} does not fit the model: {unexpected[0]!r}{more} is no key of it. Give weights of this model "
            f"(the same --model, --width, --depth)"
        )
    for key, want in expected.items():
        got = _shape_of(found[key])
        if isinstance(want, torch.Tensor) and got is not None and got != tuple(want.shape):
            raise ConfigError(
                f"{what} does not fit the model: {key!r} has shape {got} there, {tuple(want.shape)} in "
                f"the model. Give weights of this model (the same --model, --width, --depth)"
            )


def _shape_of(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor, or of one described or read on demand (a DCP entry, a FileTensor, a StoredTensor)."""
    if isinstance(value, torch.Tensor | _Shaped | FileTensor | StoredTensor):
        return tuple(value.shape)
    return None


class _Shaped:
    """A tensor as a DCP directory's metadata describes it, checked before anything is read."""

    def __init__(self, shape: torch.Size) -> None:
        self.shape = shape


def _load_dcp(path: Path, model: nn.Module, expected: Mapping[str, Any], flag: str) -> str:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load

    reader = FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    # paratrain checkpoint export's layout ({"model": ...}), else a model state dict saved at the top
    prefix = "model." if all(f"model.{key}" in stored for key in expected) else ""
    described: dict[str, Any] = {}
    for key, entry in stored.items():
        if key.startswith(prefix):
            described[key.removeprefix(prefix)] = (
                _Shaped(entry.size) if isinstance(entry, TensorStorageMetadata) else entry
            )
    check_fits_model(expected, described, f"{flag} {path}")
    state = dict(expected)  # the model's own tensors: read into in place
    target: dict[str, Any] = {"model": state} if prefix else state
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(target, storage_reader=reader, no_dist=True)
    model.load_state_dict(state)  # non-tensor entries (an _extra_state) were replaced, not filled in
    tensors = sum(isinstance(value, torch.Tensor) for value in state.values())
    return f"DCP directory, {tensors} tensors"


def _paratrain_model(path: Path) -> dict[str, Any]:
    state = open_sharded(path) if is_sharded_checkpoint(path) else load_checkpoint(path)
    if not isinstance(state.get("model"), Mapping):
        raise CheckpointError(f"checkpoint {path} has no 'model' entry (keys: {describe_keys(list(state))})")
    model: dict[str, Any] = materialize(state["model"])  # only the model's slices are read
    return model


def _torch_file(path: Path, flag: str) -> tuple[dict[str, Any], str]:
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise CheckpointError(
            f"{flag} {path}: cannot read it as a torch file ({str(exc).splitlines()[0]}); give a state dict (.pt), a "
            f"safetensors file (named .safetensors), a DCP directory or a paratrain checkpoint"
        ) from exc
    if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
        return _paratrain_model(path), f"paratrain checkpoint {path}"  # read again, its digest checked
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), Mapping):
        return dict(loaded["model"]), "torch file, its 'model' entry"
    if isinstance(loaded, Mapping) and all(isinstance(key, str) for key in loaded):
        return dict(loaded), "torch state dict"
    raise CheckpointError(f"{flag} {path}: a torch file, but no state dict (a {type(loaded).__name__})")
