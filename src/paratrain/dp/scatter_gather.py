"""Split a batch across devices and put the replicas' outputs back together.

Both directions are plain tensor operations (``split``, ``to``, ``cat``), so autograd carries gradients
through them: the gradient of a gathered output flows back to each replica, and the gradient of a scattered
input flows back to the caller's tensor.

    split_sizes(30, 4)                                  # [8, 8, 7, 7]
    per_device = scatter((x,), {"mask": m}, devices, dim=0)
    out = gather([r(*a, **k) for r, (a, k) in ...], torch.device("cpu"), dim=0)
    shard(torch.arange(10), rank=1, world_size=3)      # tensor([4, 5, 6]): a process's slice, same rule
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.errors import ConfigError, GatherError, ScatterError
from paratrain.tree import TreeSpec, flatten, leaf_paths, unflatten

__all__ = ["Scattered", "batch_size", "check_chunk_sizes", "gather", "scatter", "shard", "split_sizes"]


def split_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Balanced split: sizes differ by at most one, the larger ones first, no device left idle.

    A batch smaller than the device count gives ``batch_size`` chunks of one.
    """
    if num_devices < 1:
        raise ConfigError(f"need at least one device to split over, found {num_devices}")
    if batch_size < 1:
        raise ScatterError(f"cannot split an empty batch (size {batch_size}) across devices")
    used = min(batch_size, num_devices)
    base, extra = divmod(batch_size, used)
    return [base + 1] * extra + [base] * (used - extra)


def check_chunk_sizes(chunk_sizes: Sequence[int], batch_size: int, num_devices: int) -> list[int]:
    """Validate explicit per-device sizes (zeros skip a device) against the batch."""
    sizes = list(chunk_sizes)
    if len(sizes) != num_devices:
        raise ConfigError(
            f"chunk_sizes has {len(sizes)} entries but there are {num_devices} devices; give one size per device"
        )
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad:
        raise ConfigError(f"chunk_sizes must be non-negative ints; found {bad} in {sizes}")
    if sum(sizes) != batch_size:
        raise ScatterError(
            f"chunk_sizes {sizes} sum to {sum(sizes)} but the batch has {batch_size} samples along the split "
            f"dimension; make them sum to the batch (use drop_last=True for a fixed batch) or pass "
            f"chunk_sizes=None for a balanced split"
        )
    return sizes


@dataclass
class Scattered:
    """One replica's share of the batch: its device slot and device, inputs, and sample count."""

    slot: int
    device: torch.device
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    size: int


def _split_dim(t: torch.Tensor, dim: int) -> int:
    return dim if dim >= 0 else t.dim() + dim


def batch_size(
    leaves: list[Any], spec: TreeSpec, dim: int = 0, name: Callable[[str], str] = lambda path: f"batch{path}"
) -> int | None:
    """The common size along ``dim`` of every tensor leaf with at least one dimension; None if none has one.

    ``name`` turns a leaf's path (``[0]['mask']``) into the name used in errors.

    Raises:
        ScatterError: a tensor has no dimension ``dim``, or two tensors disagree on its size (each is named).
    """
    found: list[tuple[int, int]] = []
    paths = None
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        d = _split_dim(leaf, dim)
        if not 0 <= d < leaf.dim():
            paths = paths or leaf_paths(spec)
            raise ScatterError(
                f"cannot split input {name(paths[i])} of shape {tuple(leaf.shape)} along dim {dim}: "
                f"it has only {leaf.dim()} dimension(s); pass a dim that every batched input has"
            )
        found.append((i, leaf.size(d)))
    if not found:
        return None
    sizes = {size for _, size in found}
    if len(sizes) > 1:
        paths = paths or leaf_paths(spec)
        listed = ", ".join(f"{name(paths[i])}: {size}" for i, size in found)
        raise ScatterError(
            f"inputs disagree on the batch size along dim {dim} ({listed}); every tensor input is split along "
            f"dim {dim}, so each must have the same size there (pass per-batch constants as Python values "
            f"or 0-dim tensors)"
        )
    return found[0][1]


def _input_name(path: str) -> str:
    # the tree is (args, kwargs): "[0][1]" -> "args[1]", "[1]['mask']" -> "kwargs['mask']"
    if path.startswith("[0]"):
        return "args" + path[3:]
    if path.startswith("[1]"):
        return "kwargs" + path[3:]
    return path


def scatter(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: Sequence[torch.device],
    dim: int = 0,
    chunk_sizes: Sequence[int] | None = None,
) -> list[Scattered]:
    """Split every tensor input along ``dim`` and move each piece to its device.

    Positional and keyword inputs follow one rule: tensors with at least one dimension are split, 0-dim
    tensors are copied to every device, and other values are passed to every replica unchanged. Devices that
    would get no samples are left out of the result.
    """
    leaves, spec = flatten((tuple(args), dict(kwargs)))
    batch = batch_size(leaves, spec, dim, _input_name)
    if batch is None:
        # nothing to split: the whole call runs once, on the first device
        moved = [_to(leaf, devices[0]) for leaf in leaves]
        a, k = unflatten(moved, spec)
        return [Scattered(0, devices[0], a, k, 0)]
    if batch == 0:
        raise ScatterError(
            f"the batch is empty (size 0 along dim {dim}); DataParallel needs at least one sample to run"
        )
    if chunk_sizes is None:
        sizes = split_sizes(batch, len(devices))
    else:
        sizes = check_chunk_sizes(chunk_sizes, batch, len(devices))
    slots = [i for i, size in enumerate(sizes) if size > 0]
    used = [(devices[i], sizes[i]) for i in slots]
    used_sizes = [size for _, size in used]
    per_device: list[list[Any]] = [[] for _ in used]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            pieces = leaf.split(used_sizes, _split_dim(leaf, dim))
            for bucket, piece, (device, _) in zip(per_device, pieces, used, strict=True):
                bucket.append(_to(piece, device))
        else:
            for bucket, (device, _) in zip(per_device, used, strict=True):
                bucket.append(_to(leaf, device))
    result = []
    for index, leaves_here, (device, size) in zip(slots, per_device, used, strict=True):
        a, k = unflatten(leaves_here, spec)
        result.append(Scattered(index, device, a, k, size))
    return result


def shard(indices: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch's indices (or of any 1-d tensor).

    Sizes are balanced as in :func:`split_sizes` (the larger slices first, differing by at most one); when the
    batch has fewer samples than ranks, the last ranks get empty slices (processes, unlike devices in one
    process, cannot be left out of a step).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be a positive int, found {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an int from 0 to {world_size - 1} (world_size - 1), found {rank!r}")
    if indices.dim() != 1:
        raise ConfigError(f"indices must be 1-d (one global batch), found shape {tuple(indices.shape)}")
    n = indices.size(0)
    if n >= world_size:
        sizes = split_sizes(n, world_size)
        start = sum(sizes[:rank])
        return indices[start : start + sizes[rank]]
    return indices[rank : rank + 1] if rank < n else indices[n:]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor) and value.device != device:
        return value.to(device, non_blocking=True)
    return value


def gather(outputs: Sequence[Any], device: torch.device, dim: int = 0) -> Any:
    """Put the replicas' outputs back into one structure on ``device``.

    Tensors are concatenated along ``dim`` (0-dim tensors become a vector, one entry per replica);
    other leaves that are equal on every replica appear once, otherwise as a list of the replicas' values.
    """
    if not outputs:
        raise GatherError("no outputs to gather")
    flat = [flatten(out) for out in outputs]
    spec0 = flat[0][1]
    for i, (_, spec) in enumerate(flat[1:], start=1):
        if spec != spec0:
            raise GatherError(
                f"replicas returned different structures: replica 0 returned {spec0.describe()} "
                f"but replica {i} returned {spec.describe()}; a module under DataParallel must return the "
                f"same structure for every slice of the batch"
            )
    columns = list(zip(*(leaves for leaves, _ in flat), strict=True))
    paths = leaf_paths(spec0)
    gathered = [_gather_leaf(list(col), device, dim, path) for col, path in zip(columns, paths, strict=True)]
    return unflatten(gathered, spec0)


def _gather_leaf(values: list[Any], device: torch.device, dim: int, path: str) -> Any:
    is_tensor = [isinstance(v, torch.Tensor) for v in values]
    if all(is_tensor):
        return _cat(values, device, dim, path)
    if any(is_tensor):
        kinds = [type(v).__name__ for v in values]
        raise GatherError(f"output {path} is a tensor on some replicas and not on others: {kinds}")
    first = values[0]
    if all(_same(first, v) for v in values[1:]):
        return first
    return values


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:  # values whose == is elementwise or raises are not "equal once"
        return False


def _cat(tensors: list[torch.Tensor], device: torch.device, dim: int, path: str) -> torch.Tensor:
    if all(t.dim() == 0 for t in tensors):
        # one scalar per replica (a per-replica loss, say) becomes a vector, as torch's gather does
        return torch.stack([t.to(device) for t in tensors])
    ndims = {t.dim() for t in tensors}
    shapes = [tuple(t.shape) for t in tensors]
    if len(ndims) > 1:
        raise GatherError(f"cannot gather output {path}: replicas returned shapes {shapes}")
    d = _split_dim(tensors[0], dim)
    if not 0 <= d < tensors[0].dim():
        raise GatherError(f"cannot gather output {path} of shapes {shapes} along dim {dim}")
    rest = {s[:d] + s[d + 1 :] for s in shapes}
    if len(rest) > 1:
        raise GatherError(
            f"cannot gather output {path} along dim {dim}: replicas returned shapes {shapes}, which must agree "
            f"in every dimension but {dim}"
        )
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) > 1:
        raise GatherError(f"cannot gather output {path}: replicas returned dtypes {sorted(map(str, dtypes))}")
    if len(tensors) == 1 and tensors[0].device == device:
        return tensors[0]
    return torch.cat([t.to(device) for t in tensors], dim=d)
