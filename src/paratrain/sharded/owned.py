"""Whether a gradient's bytes are ours to write: dividing it in place, or reducing it as it is, changes nothing else.

zero2 (at two ranks) and zero3 on gloo all-reduce a large parameter's gradient as autograd made it, divided in
place, instead of copying it into a flat buffer first (a second whole copy, in fresh pages every backward); they
may only where nothing but the parameter refers to the tensor and its bytes.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["owned"]


def owned(grad: torch.Tensor, holders: int) -> bool:
    """Whether ``grad``'s bytes are reachable through ``grad`` alone (so dividing it in place changes nothing else),
    ``holders`` being the Python references to it that the callers hold.

    After AccumulateGrad (torch/csrc/autograd/functions/accumulate_grad.{h,cpp}) a parameter's first gradient is
    autograd's own tensor, stolen when nothing else referred to it, or else a clone; the engine's reference is gone
    by the time the post-accumulate hook runs. A stolen tensor can still be a view of a larger buffer (cat's
    backward gives narrow views of one gradient) or be held elsewhere; then it is not ours to write."""
    if grad.requires_grad or not grad.is_contiguous() or grad.storage_offset() != 0:
        return False
    storage = grad.untyped_storage()
    if storage.nbytes() != grad.numel() * grad.element_size():
        return False
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    # the storage: the tensor's reference and `storage`'s; the tensor: the callers', this function's argument and
    # getrefcount's (a reference held anywhere else adds one)
    return bool(use_count(storage._cdata) == 2) and sys.getrefcount(grad) <= holders + 2
