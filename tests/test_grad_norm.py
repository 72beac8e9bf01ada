"""The norm and clipping arithmetic every strategy shares: torch's ``clip_grad_norm_``, bit for bit, when each
gradient's norm is taken whole and the scaling is applied to pieces of them."""

from __future__ import annotations

import math

import pytest
import torch

from paratrain.sharded.grad_norm import clip_coefficient, scale_grads, tensor_norm, total_norm


def _grads(mixed: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    sizes = (4097, 333, 65536 + 7, 1, 2048)
    grads = [torch.randn(n, generator=g) * (1 + k) for k, n in enumerate(sizes)]
    if mixed:  # torch groups by dtype before it stacks the norms: the order differs from the parameters'
        grads[1] = grads[1].double()
        grads[3] = grads[3].double()
    return grads


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
@pytest.mark.parametrize("mixed", [False, True])
def test_norms_of_whole_gradients_and_a_clip_of_their_pieces_are_torchs(norm_type, mixed):
    grads = _grads(mixed)
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type)

    norm = total_norm([tensor_norm(g, norm_type) for g in grads], norm_type)
    assert norm.dtype == expected.dtype and torch.equal(norm, expected)
    ours = [g.clone() for g in grads]
    pieces = [piece for g in ours for piece in g.split(1000)]  # as ranks hold them: pieces of each gradient
    scale_grads(pieces, clip_coefficient(norm, 0.5))
    for mine, theirs in zip(ours, (p.grad for p in params), strict=True):
        assert torch.equal(mine, theirs)


def test_no_gradients_give_torchs_zero():
    assert torch.equal(total_norm([], 2.0), torch.nn.utils.clip_grad_norm_([], 1.0))


def test_a_norm_summed_from_pieces_is_not_torchs_which_is_why_norms_are_taken_whole():
    """The test above can fail: float64 sums of the pieces' squares differ from torch's float32 norm somewhere."""
    g = torch.Generator().manual_seed(0)
    differs = 0
    for _ in range(50):
        grad = torch.randn(30001, generator=g)
        whole = tensor_norm(grad, 2.0)
        pieces = sum(float(torch.linalg.vector_norm(p, dtype=torch.float64)) ** 2 for p in grad.split(15001))
        differs += float(torch.tensor(pieces**0.5, dtype=torch.float32)) != float(whole)
    assert differs > 0
