"""Gradient accumulation: one batch cut into micro-batches whose gradients add up to the whole batch's mean.

    for x, y in par.accumulate(model, batch, steps=4):   # up to 4 micro-batches; only the last synchronises
        par.backward(criterion(model(x), y))
    par.step(optimizer); optimizer.zero_grad()            # one optimizer step per batch

The rule: the batch a process holds (its share of the global batch, from a prepared loader) is cut along dim 0
into ``min(steps, global batch)`` contiguous micro-batches whose sizes differ by at most one, the larger ones
first (as :func:`~paratrain.dp.scatter_gather.split_sizes` splits a batch over devices). Every process makes the
same number of micro-batches, so under ddp they all synchronise on the same one; a process whose share is
smaller than that count gets some empty micro-batches (its gradient from them is zero).

Each micro-batch's mean loss is weighted by its samples over the process's share, on top of the share's own
weight, so the gradient after the last micro-batch is the mean over the whole global batch, however unevenly
it splits.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.dp.scatter_gather import batch_size
from paratrain.errors import ConfigError
from paratrain.tree import flatten, unflatten

__all__ = ["check_steps", "cut", "micro_sizes", "samples_in"]


def check_steps(steps: int) -> int:
    """``steps`` if it is a positive int; ConfigError otherwise."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"accumulate steps must be a positive int (micro-batches per optimizer step); found {steps!r}"
        )
    return steps


def micro_sizes(local: int, total: int | None, steps: int) -> list[int]:
    """Samples of each micro-batch of a process's ``local`` share of a global batch of ``total`` samples.

    ``min(steps, total)`` micro-batches (``steps`` when the total is unknown), at least one; sizes differ by at
    most one, the larger first, and zeros appear only when ``local`` is smaller than the count.
    """
    parts = steps if total is None else max(1, min(steps, total))
    base, extra = divmod(local, parts)
    return [base + 1] * extra + [base] * (parts - extra)


def samples_in(batch: Any) -> int:
    """The batch's size along dim 0.

    Raises:
        ConfigError: the batch holds no tensor with a batch dimension.
        ScatterError: its tensors disagree on the batch size.
    """
    leaves, spec = flatten(batch)
    size = batch_size(leaves, spec)
    if size is None:
        raise ConfigError(
            "accumulate() cuts the batch along dim 0, but it holds no tensor with a batch dimension; pass the "
            "batch the loader yielded (tensors of shape (N, ...))"
        )
    return size


def cut(batch: Any, sizes: list[int]) -> list[Any]:
    """``batch`` cut along dim 0 into consecutive pieces of ``sizes`` (views of its tensors).

    Tensors with at least one dimension are cut; anything else (0-dim tensors, Python values) goes to every
    piece. ``sizes`` must add up to :func:`samples_in` of the batch.
    """
    leaves, spec = flatten(batch)
    pieces = []
    start = 0
    for n in sizes:
        cut_leaves = [
            leaf.narrow(0, start, n) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else leaf for leaf in leaves
        ]
        pieces.append(unflatten(cut_leaves, spec))
        start += n
    return pieces
