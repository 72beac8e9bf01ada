"""The global gradient norm and clipping, computed alike however the gradient is split across ranks.

    terms = norm_terms(grads, 2.0, device)        # sum of |g|^2 over these tensors, in float64
    terms = all-reduced over ranks                 # the sharded strategies: every rank's pieces
    norm = clip_with_norm(terms, grads, max_norm=1.0, norm_type=2.0, dtype=torch.float32)

Each term is summed in float64, so the total does not depend on how the elements were split (whole gradients on
one rank under ddp, each rank's pieces under zero1/zero2): two splits differ in float64's last bits, far below
float32's rounding, and the float32 norm and the clipping coefficient come out the same.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["clip_with_norm", "norm_terms"]


def norm_terms(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum |g|^p over ``grads`` (p = ``norm_type``; the max of |g| for inf), in float64, as a 0-dim tensor.

    float64 makes the total the same whichever way the elements are split: every rank's pieces, or every whole
    gradient on one device (the two sums differ in float64's last bits, far below float32's rounding).
    """
    if norm_type == float("inf"):
        values = [g.detach().abs().max().to(device, torch.float64) for g in grads if g.numel()]
        return torch.stack(values).max() if values else torch.zeros((), dtype=torch.float64, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float64).to(device) ** norm_type
    return total


def clip_with_norm(
    total: torch.Tensor, grads: Sequence[torch.Tensor], max_norm: float, norm_type: float, dtype: torch.dtype
) -> torch.Tensor:
    """Scale ``grads`` so the norm whose terms summed to ``total`` is at most ``max_norm``; the norm, as torch's.

    The coefficient is torch's ``clip_grad_norm_`` arithmetic on the float32 norm: the same everywhere the norm is.
    """
    norm = (total if norm_type == float("inf") else total ** (1.0 / norm_type)).to(dtype)
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.device))
    return norm
