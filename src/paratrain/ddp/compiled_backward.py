"""A compiled backward that overlaps the buckets' collectives: dynamo cuts the user's graph at about a bucket.

AOTAutograd runs a compiled backward as one autograd node: every parameter's gradient appears at its end, the
gradient hooks fire together there, and no bucket's collective overlaps the backward. Dynamo's answer, its "DDP
optimizer" (on by default: ``torch._dynamo.config.optimize_ddp``), cuts the captured graph into pieces holding
about a bucket of parameters each and compiles them one by one with the user's backend: each piece's backward is
a node of its own, so the last layers' gradients are complete, and their bucket is launched, while the first
layers' backward still runs. Dynamo applies it to the frames it compiles while a data-parallel module's forward
runs, and learns that from one class attribute of torch's DistributedDataParallel (torch's composable
``replicate`` sets it the same way). Our wrapper's forward sets it, to a record of its bucket size, around its
call into the user's module, so a model compiled before ``prepare``, in place or after it is cut alike.

HACK: ``_active_ddp_module`` is torch-private; it has had this meaning since torch 2.0. A torch without it, or
``optimize_ddp`` set to anything but the DDP optimizer, leaves the compiled backward in one piece: the first
forward of a compiled model says so in one line and training goes on, its collectives at the end of backward.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as _TorchDDP

from paratrain.compiled import compiled_inner
from paratrain.ddp.buckets import FIRST_BUCKET_BYTES

__all__ = ["SplitAt", "cut_at_buckets", "restore", "tell_if_not_cut", "why_not_cut"]

_SLOT = "_active_ddp_module"


@dataclass(frozen=True)
class SplitAt:
    """What dynamo reads of the running data-parallel module: the bucket size its graph is cut at, in bytes.

    Dynamo's cutter refuses a size under its first bucket (1 MiB): a smaller bucket cap cuts at the first
    bucket's size, a coarser cut that still overlaps."""

    bucket_bytes_cap: int


@torch.compiler.disable  # type: ignore[untyped-decorator]  # runs eagerly, outside the user's graph
def cut_at_buckets(bucket_bytes: int) -> object:
    """Frames dynamo compiles from now until :func:`restore` are cut at ``bucket_bytes``; returns what to restore."""
    previous = getattr(_TorchDDP, _SLOT, None)
    setattr(_TorchDDP, _SLOT, SplitAt(max(bucket_bytes, FIRST_BUCKET_BYTES)))
    return previous


@torch.compiler.disable  # type: ignore[untyped-decorator]
def restore(previous: object) -> None:
    setattr(_TorchDDP, _SLOT, previous)


def why_not_cut() -> str | None:
    """Why this process's compiled graphs are not cut at buckets; None when they are."""
    if not hasattr(_TorchDDP, _SLOT):
        return f"torch {torch.__version__} has no DistributedDataParallel.{_SLOT}, where dynamo learns the bucket size"
    mode = torch._dynamo.config.optimize_ddp
    if mode not in (True, "ddp_optimizer"):
        return f"torch._dynamo.config.optimize_ddp is {mode!r} (True or 'ddp_optimizer' cuts the graph at buckets)"
    return None


def tell_if_not_cut(module: nn.Module) -> None:
    """One line on stderr when a compiled ``module``'s backward stays one piece (the wrapper asks once)."""
    reason = why_not_cut() if _is_compiled(module) else None
    if reason is not None:
        print(
            f"paratrain: the compiled backward runs as one piece, its gradient collectives after it: {reason}",
            file=sys.stderr,
        )


def _is_compiled(module: nn.Module) -> bool:
    return compiled_inner(module) is not None or getattr(module, "_compiled_call_impl", None) is not None
