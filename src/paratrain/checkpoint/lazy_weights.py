"""A weights file opened to be read a tensor at a time: ``--init-from`` under zero3, each rank reading its shards.

    weights = open_weights("model.safetensors", model.state_dict())   # keys and shapes only: nothing read yet
    check_fits_model(model.state_dict(), weights.state, "--init-from model.safetensors")
    weights.state["fc1.weight"].read(0, 100)     # its first 100 elements (flattened), one tensor read at most
    weights.close()

The formats are :func:`paratrain.checkpoint.weights.load_weights`'s, each opened so that what a rank holds beyond
its own shards is about one tensor of the file at a time:

- a state dict (``.pt``, or a torch file with a ``model`` entry): its tensors are views of a read-only mapping of
  the file (:func:`paratrain.checkpoint.mapped.load_mapped`), read only where they are copied from;
- a safetensors file: ``safetensors.safe_open``, each tensor read by ``pread`` when it is asked for (the package's
  ``mmap`` backend maps the whole file private, which a data cap counts);
- a DCP directory: each tensor loaded on its own (``torch.distributed.checkpoint.load`` of one key) into a buffer
  of its shape;
- a paratrain checkpoint: a sharded one reads only the slices asked for; a one-file one is mapped as a state
  dict is (its digest checked by reading every tensor once, from the mapping).

A DDP wrapper's ``module.`` prefix is dropped, and a DCP directory's keys may sit under ``model.``, as for
``load_weights``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.consolidate import find_checkpoint
from paratrain.checkpoint.dcp_export import is_dcp_checkpoint
from paratrain.checkpoint.file import FORMAT, load_checkpoint
from paratrain.checkpoint.formats import require_safetensors
from paratrain.checkpoint.mapped import load_mapped
from paratrain.checkpoint.sharded import StoredTensor, is_sharded_checkpoint, open_sharded
from paratrain.checkpoint.state_dicts import describe_keys, strip_module_prefix
from paratrain.errors import CheckpointError, ConfigError

__all__ = ["FileTensor", "WeightFile", "open_weights"]


class FileTensor:
    """One tensor of a weights file, read when asked for: all of it, or a range of its flattened elements."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, load: Callable[[], torch.Tensor]) -> None:
        self.shape = shape
        self.dtype = dtype
        self._load = load

    def full(self) -> torch.Tensor:
        return self._load()

    def read(self, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of the flattened tensor (1-d, on the CPU)."""
        return self.full().reshape(-1).narrow(0, start, length)

    def __repr__(self) -> str:
        return f"FileTensor(shape={self.shape}, dtype={self.dtype})"


@dataclass
class WeightFile:
    """A weights file's model state, its tensors read on demand (plain tensors, :class:`FileTensor`,
    :class:`~paratrain.checkpoint.sharded.StoredTensor`); ``what`` says what was found, as ``load_weights`` says."""

    state: dict[str, Any]
    what: str
    _close: list[Callable[[], None]] = field(default_factory=list)

    @property
    def tensors(self) -> int:
        return sum(isinstance(v, torch.Tensor | FileTensor | StoredTensor) for v in self.state.values())

    def close(self) -> None:
        for close in self._close:
            close()
        self._close.clear()


def existing_weights(source: str | Path, flag: str) -> Path:
    """``source`` as a path that names something weights can be read from (a file, a DCP directory, a sharded
    checkpoint's directory for its ``.pt`` name).

    Raises:
        ConfigError: nothing is there.
    """
    path = Path(source)
    if not path.exists() and not is_sharded_checkpoint(path.with_suffix("")):
        raise ConfigError(
            f"{flag} {path}: nothing is there; give a state dict (.pt), a .safetensors file, a DCP directory or a "
            f"paratrain checkpoint"
        )
    return path


def open_weights(source: str | Path, expected: Collection[str], *, flag: str = "--init-from") -> WeightFile:
    """The weights at ``source``, opened to be read a tensor at a time (module docstring); ``expected``: the
    model's keys (they say whether a DCP directory's sit under ``model.``).

    Raises:
        ConfigError: nothing at ``source``; a safetensors file without the package.
        CheckpointError: a file that cannot be read as any of the formats.
    """
    path = existing_weights(source, flag)
    if is_dcp_checkpoint(path):
        return _dcp(path, expected)
    if path.suffix == ".safetensors" and path.is_file():
        require_safetensors(f"{flag} {path}")
        return _safetensors(path)
    if not path.is_file():  # a sharded checkpoint (or the .pt path it was saved to), a run's checkpoint directory
        found, _ = find_checkpoint(path)
        return WeightFile(strip_module_prefix(_paratrain_model(found)), f"paratrain checkpoint {found}")
    try:
        loaded = load_mapped(path)
    except Exception as exc:
        raise CheckpointError(
            f"{flag} {path}: cannot read it as a torch file ({str(exc).splitlines()[0]}); give a state dict (.pt), a "
            f"safetensors file (named .safetensors), a DCP directory or a paratrain checkpoint"
        ) from exc
    if isinstance(loaded, dict) and loaded.get("format") == FORMAT:
        del loaded  # read again: its markers and digest checked
        return WeightFile(strip_module_prefix(_paratrain_model(path)), f"paratrain checkpoint {path}")
    if isinstance(loaded, dict) and isinstance(loaded.get("model"), Mapping):
        return WeightFile(strip_module_prefix(loaded["model"]), "torch file, its 'model' entry")
    if isinstance(loaded, Mapping) and all(isinstance(key, str) for key in loaded):
        return WeightFile(strip_module_prefix(loaded), "torch state dict")
    raise CheckpointError(f"{flag} {path}: a torch file, but no state dict (a {type(loaded).__name__})")


def _paratrain_model(path: Path) -> dict[str, Any]:
    state = open_sharded(path) if is_sharded_checkpoint(path) else load_checkpoint(path, mapped=True)
    if not isinstance(state.get("model"), Mapping):
        raise CheckpointError(f"checkpoint {path} has no 'model' entry (keys: {describe_keys(list(state))})")
    return dict(state["model"])


def _safetensors(path: Path) -> WeightFile:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", backend="pread")
    except TypeError:  # a safetensors before 0.8 has no backend: its mapping then counts against a data cap
        handle = safe_open(str(path), framework="pt")
    state: dict[str, Any] = {}
    names: list[str] = handle.keys()  # a safe_open handle is not iterable
    for key in names:
        part = handle.get_slice(key)
        dtype = _SAFETENSORS_DTYPES.get(part.get_dtype())
        state[key] = FileTensor(
            tuple(part.get_shape()),
            dtype if dtype is not None else torch.float32,
            functools.partial(handle.get_tensor, key),
        )
    return WeightFile(strip_module_prefix(state), "safetensors")


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _dcp(path: Path, expected: Collection[str]) -> WeightFile:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(path))
    stored = reader.read_metadata().state_dict_metadata
    # paratrain checkpoint export's layout ({"model": ...}), else a model state dict saved at the top
    prefix = "model." if expected and all(f"model.{key}" in stored for key in expected) else ""
    state: dict[str, Any] = {}
    for key, entry in stored.items():
        if not key.startswith(prefix):
            continue
        name = key.removeprefix(prefix)
        if isinstance(entry, TensorStorageMetadata):
            shape, dtype = tuple(entry.size), entry.properties.dtype
            state[name] = FileTensor(shape, dtype, functools.partial(_dcp_one, reader, prefix, name, shape, dtype))
        else:
            state[name] = entry  # a non-tensor entry (an _extra_state): described, as load_weights describes it
    return WeightFile(state, "DCP directory")


def _dcp_one(reader: Any, prefix: str, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    from torch.distributed.checkpoint.state_dict_loader import load

    buffer = torch.empty(shape, dtype=dtype)
    target: dict[str, Any] = {"model": {name: buffer}} if prefix else {name: buffer}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        load(target, storage_reader=reader, no_dist=True)
    return buffer
