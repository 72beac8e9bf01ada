"""One zero3 unit's weights as a flat buffer: this rank's shard, the whole buffer gathered only while it is used.

    unit = ShardedUnit(0, plan[0], rank, world_size)      # plan: paratrain.sharded.units.plan_units(model)
    unit.launch_gather(ops, monitor); unit.wait_gather(monitor); unit.use()   # views of the gathered buffer
    unit.free()                                           # storage released; parameters rest (shape kept, NaN)

The layout is zero1/zero2's for one bucket (:func:`paratrain.sharded.partition.shard_bucket`): the unit's
parameters back to back, padded to ``world_size`` equal parts, rank ``r`` keeping part ``r``. Views of the buffer
made during a forward (saved for backward) stay valid across a release: the storage shrinks to nothing and grows
back, refilled by the next all-gather, under the same tensors. Between uses each parameter's data is a NaN
broadcast to its shape, which takes no memory: a read outside the unit's forward shows at once, and an in-place
write fails.
"""

from __future__ import annotations

from typing import Any

import torch

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.ops import GroupOps
from paratrain.ddp.buckets import Bucket
from paratrain.errors import DistributedError
from paratrain.sharded.guard import rest, wake
from paratrain.sharded.partition import BucketShards, Piece, shard_bucket
from paratrain.sharded.units import UnitPlan

__all__ = ["ShardedUnit", "unit_layout"]


def unit_layout(
    index: int, numels: list[int], dtype: torch.dtype, device: torch.device, world_size: int
) -> BucketShards:
    """How a unit of parameters of ``numels`` elements splits across ``world_size`` ranks (zero1/zero2's layout
    of one bucket: back to back, padded to equal parts)."""
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    bucket = Bucket(index, tuple(range(len(numels))), tuple(offsets), sum(numels), dtype, device)
    return shard_bucket(bucket, numels, world_size)


class ShardedUnit:
    """One unit's flat weights: this rank's shard, the gathered buffer (storage released between uses), gradients."""

    def __init__(
        self, index: int, plan: UnitPlan, rank: int, world_size: int, device: torch.device | None = None
    ) -> None:
        self.index = index
        self.name = plan.name
        self.module = plan.module
        self.params = list(plan.params)
        self.names = list(plan.names)
        self.rank = rank
        self.world_size = world_size
        self.dtype = self.params[0].dtype
        self.device = device if device is not None else self.params[0].device
        numels = [p.numel() for p in self.params]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        self.offsets = offsets
        # the layout is zero1/zero2's: one bucket, parameters back to back, split into world_size equal parts
        self.layout: BucketShards = unit_layout(index, numels, self.dtype, self.device, world_size)
        self.part = self.layout.part
        self.trainable = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.frozen = len(self.trainable) < len(self.params)
        self.shard = torch.zeros(self.part, dtype=self.dtype, device=self.device)
        self.full = torch.zeros(self.layout.padded, dtype=self.dtype, device=self.device)
        self._bytes = self.full.untyped_storage().nbytes()
        self.views = [
            self.full.narrow(0, o, n).view(p.shape) for o, n, p in zip(offsets, numels, self.params, strict=True)
        ]
        nan = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
        self.resting = [nan.expand(p.shape) for p in self.params]  # a parameter between uses: its shape, no memory
        self.gathered = True  # the buffer holds the whole weights (true while the constructor fills it)
        self.gathering: tuple[Any, int] | None = None  # an all-gather in flight: (Work or future, its number)
        self.in_use = False  # the parameters are views of the buffer
        # gradients: the whole unit's while they arrive (undivided inside no_sync), and this rank's part of the sum
        self.grad_full: torch.Tensor | None = None
        self.holds = [False] * len(self.params)  # grad_full has a value for parameter i
        self.taken: list[tuple[int, torch.Tensor]] = []  # autograd's gradients arrived, not yet in grad_full
        self.shard_grad: torch.Tensor | None = None
        self.checksum = 0.0  # the whole unit's sum when it was materialised from the meta device
        self._reset_backward()

    def _reset_backward(self) -> None:
        self.pending = len(self.trainable)  # trainable parameters whose gradient has not arrived in this backward
        self.arrived = [False] * len(self.params)
        self.backward_started = False
        self.reduce_launched = False
        self.waits_for_inputs = False  # the forward's inputs need gradients: the unit's backward ends with theirs
        self.inputs_done = False

    # -- the gathered weights ---------------------------------------------------------------------------------

    def own_part(self) -> torch.Tensor:
        return self.full.narrow(0, self.rank * self.part, self.part)

    def launch_gather(self, ops: GroupOps, monitor: CollectiveMonitor) -> None:
        """Start gathering every rank's shard into the whole buffer."""
        if self.gathered or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self._bytes)
        seq = monitor.launched()
        self.gathering = (ops.all_gather(self.full, self.shard), seq)

    def wait_gather(self, monitor: CollectiveMonitor) -> None:
        if self.gathering is not None:
            work, seq = self.gathering
            self.gathering = None
            monitor.wait(work, seq, f"all-gather of the weights of unit {self.label}")
            self.gathered = True

    def use(self) -> None:
        """Make the parameters views of the gathered buffer (it must be gathered)."""
        if not self.in_use:
            for p, view in zip(self.params, self.views, strict=True):
                wake(p, view)
            self.in_use = True

    def free(self) -> None:
        """Release the gathered buffer's storage; the parameters rest (their shape; a read raises, sharded/guard.py)."""
        if self.gathering is not None:
            return  # still being filled: freed when it is waited for and used, or at the end of backward
        for p, resting in zip(self.params, self.resting, strict=True):
            rest(p, resting)
        self.in_use = False
        if self.gathered:
            self.full.untyped_storage().resize_(0)
            self.gathered = False

    def keep_own_part(self) -> None:
        """The shard from the gathered buffer (after the buffer was written: construction, loading)."""
        self.shard.copy_(self.own_part())

    @property
    def label(self) -> str:
        return repr(self.name) if self.name else "(the root)"

    # -- gradients --------------------------------------------------------------------------------------------

    def take_grad(self, i: int) -> None:
        """Parameter ``i``'s gradient arrived: autograd's tensor is kept aside (:meth:`absorb` puts it into the
        unit's whole gradient), so the copy need not sit beside the unit's weights, still gathered for its backward."""
        p = self.params[i]
        grad = p.grad
        p.grad = None
        if grad is None:
            return
        if self.arrived[i]:
            raise DistributedError(
                f"parameter {self.names[i]!r} received its gradient twice in one backward (reentrant activation "
                f"checkpointing runs a backward inside the backward): zero3 reduces each unit once its gradients "
                f"are in; use torch.utils.checkpoint with use_reentrant=False, or strategy ddp"
            )
        self.arrived[i] = True
        self.pending -= 1
        self.taken.append((i, grad.detach() if grad.requires_grad else grad))

    def absorb(self, sync: bool) -> None:
        """The gradients taken so far into the unit's whole gradient, in the order they arrived (divided when it
        is reduced now); autograd's tensors are let go one by one."""
        taken, self.taken = self.taken, []
        while taken:
            i, grad = taken.pop(0)
            self._add(i, grad, sync)
            del grad

    def _add(self, i: int, grad: torch.Tensor, sync: bool) -> None:
        p = self.params[i]
        assert self.grad_full is not None, "open_grad() comes first"
        slot = self.grad_full.narrow(0, self.offsets[i], p.numel()).view(p.shape)
        with torch.no_grad():
            divide = sync and self.world_size > 1  # our DDP's average: divide each rank's gradient, then sum
            if self.holds[i]:
                slot += grad  # what autograd's accumulation into .grad does, in its order
                if divide:
                    slot.div_(self.world_size)
            elif divide and grad.dtype == slot.dtype:
                torch.div(grad, self.world_size, out=slot)  # copy_ then div_ in one pass: the same numbers
            else:
                slot.copy_(grad)
                if divide:
                    slot.div_(self.world_size)
            self.holds[i] = True

    def open_grad(self, ops: GroupOps, monitor: CollectiveMonitor) -> None:
        """The unit's whole gradient, before the first of a backward's gradients goes in: zeros, or the reduced
        gradient kept from an earlier backward (gathered from every rank), to which autograd's are added as to
        ``.grad`` under ddp, in ddp's order; the next reduce-scatter then replaces this rank's part."""
        if self.grad_full is not None:
            return
        # what no gradient fills is zeroed before the reduce-scatter (ready_to_reduce), not here: one pass less
        self.grad_full = torch.empty(self.layout.padded, dtype=self.dtype, device=self.device)
        self.holds = [False] * len(self.params)
        if self.shard_grad is not None:
            seq = monitor.launched()
            work = ops.all_gather(self.grad_full, self.shard_grad)
            monitor.wait(work, seq, f"all-gather of the kept gradients of unit {self.label}")
            self.holds = [p.requires_grad for p in self.params]
            self.shard_grad = None

    def ready_to_reduce(self) -> None:
        """Before a reduce-scatter: the slots of parameters without a gradient in this backward divided too (a
        gradient kept from an earlier backward), and every element nothing filled zeros (the slots of parameters
        that have no gradient, frozen ones, the padding)."""
        full = self.grad_full
        assert full is not None, "open_grad() comes first"
        with torch.no_grad():
            covered = 0
            for i in sorted(range(len(self.params)), key=lambda i: self.offsets[i]):
                at, count = self.offsets[i], self.params[i].numel()
                if at > covered:
                    full.narrow(0, covered, at - covered).zero_()
                slot = full.narrow(0, at, count)
                if not self.holds[i]:
                    slot.zero_()
                elif not self.arrived[i] and self.params[i].requires_grad and self.world_size > 1:
                    slot.div_(self.world_size)
                covered = max(covered, at + count)
            if covered < full.numel():
                full.narrow(0, covered, full.numel() - covered).zero_()

    def add_reduced(self, part: torch.Tensor) -> None:
        """This rank's part of the reduced gradient (which holds what the unit kept before: see open_grad)."""
        self.shard_grad = part
        self.clear_grads()

    def clear_grads(self) -> None:
        """Drop the gradients of a backward in progress."""
        self.taken = []
        self.grad_full = None
        self.holds = [False] * len(self.params)

    # -- this rank's pieces -----------------------------------------------------------------------------------

    def pieces(self) -> tuple[Piece, ...]:
        return self.layout.pieces[self.rank]
