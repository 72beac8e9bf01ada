"""A torch file's tensors as views of a read-only mapping of it: nothing is read until a tensor is, and the
mapping is none that ``RLIMIT_DATA`` counts.

    state = load_mapped("model.pt")                      # torch.load's structure; every tensor a view of the file
    shard.copy_(state["fc1.weight"].reshape(-1)[a:b])    # only these pages are read

``torch.load(mmap=True)`` maps the file private and writable (``MAP_PRIVATE``, copy on write), and Linux counts
such a mapping, the whole file, against ``RLIMIT_DATA`` before a page is read: under a data cap smaller than the
file the load fails, even though reading its pages costs no memory of the process's own (they are the page
cache's). Its ``MAP_SHARED`` option opens the file for writing. Here the file's structure comes from
``torch.load(map_location="meta", weights_only=True)``, which records where each storage lies in the file, and
the bytes from one read-only mapping (``PROT_READ``). The tensors are for reading: a write into one is a
segmentation fault, so they are copied from and never handed to code that might write into them.
"""

from __future__ import annotations

import mmap
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from paratrain.tree import map_tensors

__all__ = ["load_mapped"]


def load_mapped(path: str | Path) -> Any:
    """What ``torch.load(path, weights_only=True)`` returns, every tensor a read-only view of the file (module
    docstring); a file this cannot map (a legacy torch file, another byte order) is loaded with ``torch.load(...,
    mmap=True)``, and one that is not a zip file raises as ``torch.load`` does."""
    path = Path(path)
    if not _native_zip(path):
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    described = torch.load(path, map_location="meta", weights_only=True)
    with open(path, "rb") as file:
        size = path.stat().st_size
        mapping = mmap.mmap(file.fileno(), size, access=mmap.ACCESS_READ) if size else None
    views: dict[int, torch.Tensor] = {}  # a storage's offset in the file -> its bytes

    def view(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_meta:
            return tensor
        storage = tensor.untyped_storage()
        offset = getattr(storage, "_checkpoint_offset", None)
        nbytes = storage.nbytes()
        if offset is None:
            raise RuntimeError(f"torch.load gave a meta tensor without its offset in {path}; this torch is too new")
        if offset not in views:
            if nbytes == 0 or mapping is None:
                views[offset] = torch.empty(0, dtype=torch.uint8)
            else:
                with warnings.catch_warnings():  # "the given buffer is not writable": it is read only
                    warnings.simplefilter("ignore", UserWarning)
                    views[offset] = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
        data = views[offset].view(tensor.dtype) if views[offset].numel() else torch.empty(0, dtype=tensor.dtype)
        return data.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    return map_tensors(view, described)


def _native_zip(path: Path) -> bool:
    """A zip-format torch file whose tensors are stored in this machine's byte order."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        orders = [name for name in archive.namelist() if name.endswith("/byteorder") or name == "byteorder"]
        return not orders or archive.read(orders[0]).decode() == sys.byteorder
