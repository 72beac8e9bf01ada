"""The sharded engines' collectives, chosen once per process group: the one place that knows the backend.

    ops = GroupOps(group)
    work = ops.all_gather(buffer, part)           # every rank's part into buffer (part may be this rank's slice)
    reduction = ops.reduce_scatter(part, whole)   # the sum of every rank's ``whole``, this rank's slice into part
    monitor.wait(reduction.work, seq, what); reduction.finish()

zero1, zero2 and zero3 launch every all-gather and reduce-scatter of weights and gradients through a
:class:`GroupOps`. On NCCL both are the native collectives. On gloo the all-gather is gloo's own, and the
reduce-scatter is an all-reduce of the input in place with this rank's slice copied out when it is done
(:meth:`Reduction.finish`): gloo's own reduce-scatter all-reduces a clone of the whole input, which its ``Work``
keeps (and the DDP reducer keeps each ``Work`` a step), so every bucket's clone would live through the step. The
sums are the same numbers either way; an all-reduce in place also leaves the whole sum in the input until
``finish``, which zero2 reads for each parameter's gradient norm (:attr:`Reduction.whole`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.process_groups import no_python_in_work

__all__ = ["GroupOps", "Reduction"]


@dataclass
class Reduction:
    """A reduce-scatter in flight: ``work`` to wait for, then :meth:`finish` to have this rank's part in ``part``.

    ``whole``: the input, summed in place (gloo), which holds every rank's sum until ``finish`` returns; None where
    the collective writes ``part`` itself (NCCL)."""

    work: Any
    part: torch.Tensor
    whole: torch.Tensor | None
    rank: int

    def finish(self) -> None:
        """After ``work`` was waited for: this rank's slice of the sum in ``part``."""
        if self.whole is not None:
            size = self.part.numel()
            self.part.copy_(self.whole.narrow(0, self.rank * size, size))


class GroupOps:
    """All-gather and reduce-scatter over ``group``, each the backend's best form of it (module docstring)."""

    def __init__(self, group: Any) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        # gloo's reduce-scatter keeps a clone of the whole input alive in its Work: an all-reduce in place instead
        self.reduces_in_place = dist.get_backend(self.group) == "gloo"

    def all_gather(self, buffer: torch.Tensor, part: torch.Tensor) -> Any:
        """Start gathering every rank's ``part`` into ``buffer`` (rank ``r``'s at ``r * part.numel()``): the Work."""
        with no_python_in_work():
            return dist.all_gather_into_tensor(buffer, part, group=self.group, async_op=True)

    def reduce_scatter(self, part: torch.Tensor, whole: torch.Tensor) -> Reduction:
        """Start summing every rank's ``whole`` (``world_size`` equal parts), this rank's part of the sum into
        ``part`` once :meth:`Reduction.finish` runs. On gloo ``whole`` is summed in place."""
        with no_python_in_work():
            if self.reduces_in_place:
                work = dist.all_reduce(whole, group=self.group, async_op=True)
                return Reduction(work, part, whole, self.rank)
            work = dist.reduce_scatter_tensor(part, whole, group=self.group, async_op=True)
        return Reduction(work, part, None, self.rank)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> Any:
        """Start summing (or ``op``) ``tensor`` across ranks in place: the Work."""
        with no_python_in_work():
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
