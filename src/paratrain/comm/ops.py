"""The sharded engines' collectives, chosen once per process group: the one place that knows the backend.

    ops = GroupOps(group, device)                 # device: where the tensors live (the backend serving it decides)
    work = ops.all_gather(buffer, part)           # every rank's part into buffer (part may be this rank's slice)
    reduction = ops.reduce_scatter(part, whole)   # the sum of every rank's ``whole``, this rank's slice into part
    monitor.wait(reduction.work, seq, what); reduction.finish()

zero1, zero2 and zero3 launch every all-gather and reduce-scatter of weights and gradients through a
:class:`GroupOps`. On NCCL both are the native collectives. On gloo the all-gather of parts of 4 MiB or more is one
broadcast per rank, each in place from its owner into its slice of the buffer (:class:`Works`, waited for as one
collective): gloo's own
all-gather gathers into a flat output of its own and copies it out, a temporary as large as the buffer, and took
three times as long (64 MiB from two ranks on a 2-core VM: 133-139 ms against 41-45; the same bytes cross the
wire). On gloo the reduce-scatter is an all-reduce of the input in place with this rank's slice copied out when it
is done (:meth:`Reduction.finish`): gloo's own reduce-scatter all-reduces a clone of the whole input, which its ``Work``
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
from paratrain.errors import DistributedError

__all__ = ["GroupOps", "Reduction", "Works", "serving_backend"]

# parts this large or larger are gathered by broadcasts on gloo, where the flat output's copy and memory dominate
# (4 MiB parts from two ranks: 4.8 against 8.2 ms; 32 MiB parts: 41-45 against 133-139 ms, and no temporary).
# Smaller parts take gloo's all-gather: alone a 1 KiB gather is 0.43 against 0.61 ms, and zero3's test models
# (parts up to 512 KiB) trained 2.3 times slower by broadcasts, for a reason not found yet (issue 53's note)
BROADCAST_GATHER_BYTES = 4 * 2**20

# torch 2.13 renamed the flat-tensor collectives (the old names still work, with a FutureWarning on every rank)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def serving_backend(group: Any, device: torch.device | str) -> str:
    """The backend that runs ``group``'s collectives on tensors of ``device``'s type (``gloo``, ``nccl``, ...): the
    one check of the backend. A group names one backend for every device type (``gloo``) or one per type
    (``cpu:gloo,cuda:nccl``, what ``init_process_group()`` makes when given no backend).

    Raises:
        DistributedError: the group names no backend for that device type.
    """
    config = str(dist.get_backend(group if group is not None else dist.group.WORLD))
    kind = torch.device(device).type
    if ":" not in config:
        return config
    for pair in config.split(","):
        device_type, _, backend = pair.partition(":")
        if device_type.strip() == kind:
            return backend.strip()
    raise DistributedError(
        f"the process group's backends ({config}) serve no {kind} tensors: keep the model on a device the group "
        f"serves, or initialise the group with a backend for {kind} (for example 'cpu:gloo,cuda:nccl')"
    )


class Works(tuple[Any, ...]):
    """Several ``Work`` launched together as one collective of the caller's (a gather by one broadcast per rank):
    :meth:`~paratrain.comm.collectives.CollectiveMonitor.wait` waits for each, in order, as for one; :meth:`wait`
    does the same where a plain ``Work.wait()`` was called."""

    def wait(self, timeout: Any = None) -> bool:
        for work in self:
            work.wait() if timeout is None else work.wait(timeout)
        return True


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
    """All-gather and reduce-scatter over ``group`` of tensors on ``device``, each the best form of it for the backend
    that serves that device (module docstring)."""

    def __init__(
        self, group: Any, device: torch.device | str, broadcast_gather_bytes: int = BROADCAST_GATHER_BYTES
    ) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        gloo = serving_backend(self.group, device) == "gloo"
        # gloo's reduce-scatter keeps a clone of the whole input alive in its Work: an all-reduce in place instead
        self.reduces_in_place = gloo
        # gloo's all-gather goes through a flat output of its own: a broadcast from each rank in place instead
        self.gathers_by_broadcast = gloo
        self.broadcast_gather_bytes = broadcast_gather_bytes
        self._sources = [dist.get_global_rank(self.group, r) for r in range(dist.get_world_size(self.group))]  # type: ignore[arg-type]

    def all_gather(self, buffer: torch.Tensor, part: torch.Tensor) -> Any:
        """Start gathering every rank's ``part`` into ``buffer`` (rank ``r``'s at ``r * part.numel()``): the Work (on
        gloo, for parts of ``broadcast_gather_bytes`` or more, a :class:`Works`: one broadcast per rank, ``part``
        copied into its place first)."""
        with no_python_in_work():
            size = part.numel()
            if not self.gathers_by_broadcast or size * part.element_size() < self.broadcast_gather_bytes:
                return _all_gather_flat(buffer, part, group=self.group, async_op=True)
            mine = buffer.narrow(0, self.rank * size, size)
            if mine.data_ptr() != part.data_ptr():
                mine.copy_(part)
            return Works(
                dist.broadcast(buffer.narrow(0, r * size, size), src=source, group=self.group, async_op=True)
                for r, source in enumerate(self._sources)
            )

    def reduce_scatter(self, part: torch.Tensor, whole: torch.Tensor) -> Reduction:
        """Start summing every rank's ``whole`` (``world_size`` equal parts), this rank's part of the sum into
        ``part`` once :meth:`Reduction.finish` runs. On gloo ``whole`` is summed in place."""
        with no_python_in_work():
            if self.reduces_in_place:
                work = dist.all_reduce(whole, group=self.group, async_op=True)
                return Reduction(work, part, whole, self.rank)
            work = _reduce_scatter_flat(part, whole, group=self.group, async_op=True)
        return Reduction(work, part, None, self.rank)

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> Any:
        """Start summing (or ``op``) ``tensor`` across ranks in place: the Work."""
        with no_python_in_work():
            return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
