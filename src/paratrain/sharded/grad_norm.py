"""The global gradient norm and clipping: torch's arithmetic on whole gradients, applied to any split of them.

    norms = [tensor_norm(g, 2.0) for g in whole_grads]    # each gradient's norm, as torch's clip_grad_norm_ takes it
    norm = total_norm(norms, 2.0)                          # torch's total of them
    scale_grads(grads, clip_coefficient(norm, max_norm))   # any split of the gradients: elementwise, the same numbers

torch's float32 norm of a tensor cannot be rebuilt from pieces of it (summing the pieces' squares, even in float64,
gave another last bit on 6 steps of 20), so each norm is taken on a whole gradient: under ddp and zero1 every rank
holds them; zero2 measures each bucket while it is whole during its reduction (or gathers it back whole for the
norm); zero3 gathers each unit's back whole, one unit at a time. ``par.clip_grad_norm_`` under every strategy then
returns what ``torch.nn.utils.clip_grad_norm_`` returns on torch's DDP, and clips to the same gradients, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

__all__ = ["clip_coefficient", "clip_to", "scale_grads", "tensor_norm", "total_norm"]


def tensor_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``grad``'s own norm, by the kernel torch's ``clip_grad_norm_`` uses for it (foreach where torch uses foreach).

    A tensor's norm does not depend on the other tensors in torch's list (each tensor's chunks are reduced on their
    own), so one gradient at a time gives torch's numbers.
    """
    grad = grad.detach()
    if _has_foreach_support([grad], grad.device):
        found: torch.Tensor = torch._foreach_norm([grad], norm_type)[0]
    else:
        found = torch.linalg.vector_norm(grad, norm_type)
    return found


def total_norm(norms: Sequence[torch.Tensor], norm_type: float) -> torch.Tensor:
    """torch's total of the gradients' norms: grouped by device and dtype as torch groups the gradients, stacked."""
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    grouped = _group_tensors_by_device_and_dtype([list(norms)])  # each norm has its gradient's device and dtype
    ordered = [n.to(first) for ([group], _) in grouped.values() for n in group if n is not None]
    total: torch.Tensor = torch.linalg.vector_norm(torch.stack(ordered), norm_type)
    return total


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's factor on every gradient: ``max_norm / (norm + 1e-6)``, at most 1."""
    return torch.clamp(float(max_norm) / (norm + 1e-6), max=1.0)


def scale_grads(grads: Sequence[torch.Tensor], coefficient: torch.Tensor) -> None:
    """Multiply ``grads`` by ``coefficient`` in place (elementwise: the same numbers for a whole tensor or a piece)."""
    on: dict[torch.device, torch.Tensor] = {}
    for g in grads:
        factor = on.get(g.device)
        if factor is None:
            factor = on[g.device] = coefficient.to(g.device)
        g.mul_(factor)


def clip_to(
    norms: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float, norm_type: float
) -> torch.Tensor:
    """torch's total of the whole gradients' ``norms``, and ``grads`` (any pieces of them) scaled by its coefficient."""
    norm = total_norm(norms, norm_type)
    with torch.no_grad():
        scale_grads(grads, clip_coefficient(norm, max_norm))
    return norm
