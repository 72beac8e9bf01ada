"""What DistributedDataParallel decides from torch's constructor arguments, and checks across ranks at start-up.

Each argument function takes arguments as torch's ``DistributedDataParallel`` spells them and either returns
what ours does with them or raises an error that names the argument: an argument ours does not implement is
never accepted silently. ``docs/ddp.md`` has the whole table.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.process_groups import group_sequence, keep_forever, wait_work
from paratrain.devices import DeviceLike, parse_device
from paratrain.errors import ConfigError, DeviceError, DistributedError

__all__ = [
    "agree_at_start_up",
    "buffer_settings",
    "check_device",
    "choose_group",
    "describe_mismatch",
    "group_name",
    "refuse_unsupported",
    "require_trainable",
    "warn_check_reduction",
]

_UNSUPPORTED = {
    "delay_all_reduce_named_params": "its parameters would be all-reduced apart from the buckets",
    "param_to_hook_all_reduce": "it goes with delay_all_reduce_named_params",
    "mixed_precision": "torch's private _MixedPrecision; use torch.autocast, or paratrain.Parallel(precision=...)",
    "bucket_cap_mb_list": "one cap per bucket; use bucket_cap_mb",
}


def refuse_unsupported(**arguments: Any) -> None:
    """torch's arguments that ours does not implement: a ConfigError naming each one given (not None)."""
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        details = "; ".join(f"{name} ({_UNSUPPORTED[name]})" for name in given)
        raise ConfigError(
            f"paratrain's DistributedDataParallel does not support {', '.join(given)}: {details}. Leave "
            f"{'it' if len(given) == 1 else 'them'} out, or use torch.nn.parallel.DistributedDataParallel"
        )


def warn_check_reduction(check_reduction: bool) -> None:
    if check_reduction:
        warnings.warn(
            "the `check_reduction` argument of DistributedDataParallel is deprecated (by torch) and ignored",
            FutureWarning,
            stacklevel=3,
        )


def require_trainable(module: nn.Module, ignored: frozenset[str] = frozenset()) -> None:
    """A module DDP can average: some parameter requires a gradient, and none is a lazy one still uninitialised."""
    params = [p for name, p in module.named_parameters() if name not in ignored]
    if not any(p.requires_grad for p in params):
        found = f"{len(params)} parameter(s), none requiring a gradient" if params else "no parameters at all"
        if ignored:
            found += f" besides the {len(ignored)} it asks DDP to ignore"
        raise DistributedError(
            f"DistributedDataParallel needs a module with a parameter that requires a gradient (it averages "
            f"gradients); {type(module).__name__} has {found}. Wrap a trainable module, or use the module as it "
            f"is for inference"
        )
    for name, p in module.named_parameters():
        if isinstance(p, nn.parameter.UninitializedParameter):
            raise DistributedError(
                f"parameter {name!r} is not initialised yet (a lazy module): run one forward on a sample batch "
                f"before wrapping the module in DistributedDataParallel"
            )


def choose_group(process_group: Any, device_mesh: Any) -> Any:
    """The group to average over: ``process_group``, a one-dimensional ``device_mesh``'s, or the world's."""
    if device_mesh is not None:
        if process_group is not None:
            raise ConfigError("pass process_group or device_mesh to DistributedDataParallel, not both")
        if device_mesh.ndim != 1:
            raise ConfigError(
                f"DistributedDataParallel takes a device_mesh of one dimension; found {device_mesh.ndim} "
                f"dimensions: pass the data-parallel dimension, device_mesh[name]"
            )
        process_group = device_mesh.get_group(mesh_dim=0)
    group = process_group if process_group is not None else dist.group.WORLD
    if dist.get_rank(group) < 0:
        raise ConfigError(
            f"rank {dist.get_rank()} is not a member of the process_group given to DistributedDataParallel: "
            f"wrap the model only in the processes of that group (dist.new_group(ranks) returns a placeholder to "
            f"the others)"
        )
    return group


def check_device(module: nn.Module, device_ids: Sequence[DeviceLike] | None) -> torch.device | None:
    """The one device of ``device_ids`` (``None`` or ``[]``: none), checked against where the module is."""
    if device_ids is None:
        return None
    if isinstance(device_ids, (str, int, torch.device)) or len(device_ids) > 1:
        raise ConfigError(
            f"device_ids must be None or a list with this process's one device, e.g. [local_rank]; found {device_ids!r}"
        )
    if len(device_ids) == 0:
        return None  # torch takes [] for None
    device = parse_device(device_ids[0], what="device_ids[0]")
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        if t.device != device:
            raise DeviceError(
                f"DistributedDataParallel expects the module on {device} (device_ids[0]), but {name!r} is "
                f"on {t.device}; call module.to({str(device)!r}) before wrapping it"
            )
    return device


def buffer_settings(broadcast_buffers: bool | None, forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """(broadcast buffers at each forward, broadcast them at start-up), from torch's two arguments.

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers``, which leaves the start-up broadcast
    on; where the installed torch has the new name, the old one warns as torch's does.
    """
    if broadcast_buffers is not None and _torch_deprecates_broadcast_buffers():
        ignored = "; it is ignored, since forward_sync_buffers is given" if forward_sync_buffers is not None else ""
        warnings.warn(
            "`broadcast_buffers` is deprecated (by torch); use `forward_sync_buffers`, which keeps the start-up "
            "broadcast of buffers" + ignored,
            FutureWarning,
            stacklevel=3,
        )
    if forward_sync_buffers is not None:
        return forward_sync_buffers, True
    every_forward = broadcast_buffers if broadcast_buffers is not None else True
    return every_forward, every_forward


def _torch_deprecates_broadcast_buffers() -> bool:
    return "forward_sync_buffers" in inspect.signature(nn.parallel.DistributedDataParallel.__init__).parameters


def agree_at_start_up(group: Any, signature: list[Any], timeout: float | None, device: torch.device) -> str:
    """Check that every rank holds the same parameters (``signature``: names, shapes, dtypes); return the
    namespace of the wrapper's collective monitor.

    One all-gather carries a digest of the signature and how many collectives the group has run (torch counts
    them per group). The namespace is built from the largest count: the same on every rank, and larger than that
    of any earlier wrapper over the group, so its store keys can neither drift apart across ranks nor collide
    with another wrapper's. Where the digests differ, the signatures themselves are gathered for the error, and
    the Works of these collectives are kept to the end of the process: the error is raised a moment after they
    completed, and the user's script may exit at once (see :mod:`paratrain.comm.process_groups`).
    """
    world_size = dist.get_world_size(group)
    digest = int.from_bytes(hashlib.sha256(repr(signature).encode()).digest()[:7], "big")
    mine = torch.tensor([digest, group_sequence(group)], dtype=torch.int64, device=device)
    everyone = [torch.zeros_like(mine) for _ in range(world_size)]
    work = dist.all_gather(everyone, mine, group=group, async_op=True)
    _wait_for_everyone(work, timeout)
    agreed = max(int(t[1]) for t in everyone)
    if any(int(t[0]) != digest for t in everyone):
        keep_forever(work)
        raise DistributedError(describe_mismatch(_gather_signatures(group, signature, timeout, device)))
    return f"ddp-{group_name(group)}-{agreed}"


def _wait_for_everyone(work: Any, timeout: float | None) -> None:
    if not wait_work(work, timeout):
        raise DistributedError(
            f"rank {dist.get_rank()}: the start-up check of DistributedDataParallel did not complete within "
            f"{timeout:g}s: some rank of the group has not constructed its wrapper (or is stuck). Wrap the "
            f"model in every process, at the same point of the script"
        )


def _gather_signatures(group: Any, signature: list[Any], timeout: float | None, device: torch.device) -> list[Any]:
    """Every rank's signature (as JSON: nothing is unpickled from the other ranks), on the way to the start-up
    error; the Works of its two all-gathers are kept to the end of the process (see agree_at_start_up)."""
    world_size = dist.get_world_size(group)
    encoded = torch.tensor(list(json.dumps(signature).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([encoded.numel()], dtype=torch.int64, device=device)
    lengths = [torch.zeros_like(length) for _ in range(world_size)]
    work = dist.all_gather(lengths, length, group=group, async_op=True)
    keep_forever(work)
    _wait_for_everyone(work, timeout)
    padded = torch.zeros(max(int(n) for n in lengths), dtype=torch.uint8, device=device)
    padded[: encoded.numel()] = encoded
    parts = [torch.zeros_like(padded) for _ in range(world_size)]
    work = dist.all_gather(parts, padded, group=group, async_op=True)
    keep_forever(work)
    _wait_for_everyone(work, timeout)
    return [json.loads(bytes(part[: int(n)].tolist())) for part, n in zip(parts, lengths, strict=True)]


def group_name(group: Any) -> str:
    name = getattr(group, "group_name", None)
    return str(name) if name is not None else "world"


def describe_mismatch(signatures: list[Any]) -> str:
    """The start-up error when ranks hold different parameters: the first difference of each rank from rank 0."""
    reference = signatures[0]
    lines = []
    for rank, signature in enumerate(signatures[1:], start=1):
        if signature == reference:
            continue
        for i in range(max(len(signature), len(reference))):
            mine = signature[i] if i < len(signature) else None
            theirs = reference[i] if i < len(reference) else None
            if mine != theirs:
                lines.append(f"rank 0 has {_fmt(theirs)} but rank {rank} has {_fmt(mine)} (parameter #{i})")
                break
    different = [str(r) for r, s in enumerate(signatures) if s != reference]
    return (
        f"the model's parameters differ across ranks (ranks {', '.join(different)} differ from rank 0): "
        + "; ".join(lines)
        + ". Build the same model, with the same settings, in every process before wrapping it"
    )


def _fmt(entry: Any) -> str:
    if entry is None:
        return "no parameter"
    name, shape, dtype = entry
    return f"{name!r} {tuple(shape)} {dtype.removeprefix('torch.')}"
