"""One zero3 unit's weights as a flat buffer: this rank's shard, the whole buffer gathered only while it is used.

    unit = ShardedUnit(0, plan[0], rank, world_size)      # plan: paratrain.sharded.units.plan_units(model)
    unit.launch_gather(group, monitor); unit.wait_gather(monitor); unit.use()   # parameters: views of the buffer
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
from paratrain.comm.process_groups import no_python_in_work
from paratrain.ddp.buckets import Bucket
from paratrain.errors import DistributedError
from paratrain.sharded.owned import owned
from paratrain.sharded.pair_gather import PairGather
from paratrain.sharded.partition import BucketShards, Piece, shard_bucket
from paratrain.sharded.reducer import all_gather_into
from paratrain.sharded.units import UnitPlan

__all__ = ["DIRECT_MIN_NUMEL", "ShardedUnit", "unit_layout"]

# a parameter of at least this many elements and at least a quarter of its unit is reduced as a tensor of its own in
# a synchronising backward on gloo (see ShardedUnit.open_grad): its copy into the unit's flat gradient would be a
# second whole copy of most of the unit's gradient. Below 64Ki elements (256 KiB in fp32) the copy saved is small
# next to a collective's fixed cost, and the unit's small parameters share one flat buffer (one collective)
DIRECT_MIN_NUMEL = 1 << 16


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
            self.full.narrow(0, o, n).view_as(p) for o, n, p in zip(offsets, numels, self.params, strict=True)
        ]
        nan = torch.full((), float("nan"), dtype=self.dtype, device=self.device)
        self.resting = [nan.expand(p.shape) for p in self.params]  # a parameter between uses: its shape, no memory
        self.gathered = True  # the buffer holds the whole weights (true while the constructor fills it)
        self.gathering: tuple[Any, int] | None = None  # an all-gather in flight: (Work or future, its number)
        self.in_use = False  # the parameters are views of the buffer
        # gradients: the whole unit's while they arrive (undivided inside no_sync), and this rank's part of the sum
        self.grad_full: torch.Tensor | None = None
        self.holds = [False] * len(self.params)  # grad_full has a value for parameter i
        self.shard_grad: torch.Tensor | None = None
        # the large parameters (DIRECT_MIN_NUMEL, a quarter of the unit), whose gradient a synchronising backward on
        # gloo reduces as a tensor of its own, and the small ones, back to back in one flat buffer meanwhile
        total = sum(numels)
        self.large = [i for i in self.trainable if numels[i] >= max(DIRECT_MIN_NUMEL, (total + 3) // 4)]
        small = [i for i in self.trainable if i not in self.large]
        self.small_offsets = {i: sum(numels[j] for j in small[:k]) for k, i in enumerate(small)}
        self.small_numel = sum(numels[i] for i in small)
        self.split = False  # this backward's gradients: the large ones in `direct`, the small ones in grad_small
        self.direct: dict[int, torch.Tensor] = {}
        self.grad_small: torch.Tensor | None = None
        self.checksum = 0.0  # the whole unit's sum when it was materialised from the meta device
        self._reset_backward()

    def _reset_backward(self) -> None:
        if self.split:  # left by a backward that raised before its reduce was settled: nothing to keep
            self.split, self.direct, self.grad_small = False, {}, None
        self.pending = len(self.trainable)  # trainable parameters whose gradient has not arrived in this backward
        self.arrived = [False] * len(self.params)
        self.backward_started = False
        self.reduce_launched = False
        self.waits_for_inputs = False  # the forward's inputs need gradients: the unit's backward ends with theirs
        self.inputs_done = False

    # -- the gathered weights ---------------------------------------------------------------------------------

    def own_part(self) -> torch.Tensor:
        return self.full.narrow(0, self.rank * self.part, self.part)

    def launch_gather(self, group: Any, monitor: CollectiveMonitor, pair: PairGather | None = None) -> None:
        """Start gathering every rank's shard into the whole buffer: an all-gather, or with ``pair`` (two ranks on
        gloo) a send of this rank's shard and a receive of the peer's, this rank's copied in meanwhile."""
        if self.gathered or self.gathering is not None:
            return
        self.full.untyped_storage().resize_(self._bytes)
        seq = monitor.launched()
        if pair is not None:
            theirs = self.full.narrow(0, (1 - self.rank) * self.part, self.part)
            done = pair.exchange(self.shard, theirs, seq)
            with torch.no_grad():
                self.own_part().copy_(self.shard)
            self.gathering = (done, seq)
            return
        with no_python_in_work():
            work = all_gather_into(self.full, self.shard, group)
        self.gathering = (work, seq)

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
                p.data = view
            self.in_use = True

    def free(self) -> None:
        """Release the gathered buffer's storage; the parameters rest (their shape, reading NaN)."""
        if self.gathering is not None:
            return  # still being filled: freed when it is waited for and used, or at the end of backward
        for p, resting in zip(self.params, self.resting, strict=True):
            p.data = resting
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

    def take_grad(self, i: int, sync: bool) -> None:
        """Parameter ``i``'s gradient arrived: into the unit's whole gradient (divided when it is reduced now)."""
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
        if self.split:
            with torch.no_grad():
                self._take_split(i, grad)
            return
        assert self.grad_full is not None, "open_grad() comes first"
        slot = self.grad_full.narrow(0, self.offsets[i], p.numel()).view_as(p)
        if grad.requires_grad:
            grad = grad.detach()
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

    def _take_split(self, i: int, grad: torch.Tensor) -> None:
        """A gradient of a split backward (open_grad): divided by the world size, as take_grad divides into the flat
        buffer (the same operation on the same numbers), a large parameter's kept as a tensor of its own: autograd's
        own, divided in place, where nothing else can see it, or else a copy."""
        p = self.params[i]
        if i in self.small_offsets:
            assert self.grad_small is not None, "open_grad() comes first"
            slot = self.grad_small.narrow(0, self.small_offsets[i], p.numel()).view_as(p)
        # holders: take_grad's local and this method's argument
        elif grad.dtype == self.dtype and grad.device == self.device and owned(grad, holders=2):
            self.direct[i] = grad.div_(self.world_size)
            return
        else:
            slot = torch.empty(p.shape, dtype=self.dtype, device=self.device)
            self.direct[i] = slot
        if grad.requires_grad:
            grad = grad.detach()
        if grad.dtype == slot.dtype:
            torch.div(grad, self.world_size, out=slot)
        else:
            slot.copy_(grad)
            slot.div_(self.world_size)

    def open_grad(self, group: Any, monitor: CollectiveMonitor, split: bool = False) -> None:
        """The unit's whole gradient, before the first of a backward's gradients goes in: zeros, or the reduced
        gradient kept from an earlier backward (gathered from every rank), to which autograd's are added as to
        ``.grad`` under ddp, in ddp's order; the next reduce-scatter then replaces this rank's part.

        ``split`` (a synchronising backward whose reduce is an all-reduce in place, on gloo): where nothing is kept
        from an earlier backward and the unit has large parameters, there is no whole gradient: each large
        parameter's gradient is all-reduced as a tensor of its own (autograd's, not copied), the small ones in one
        flat buffer of their own, and this rank's part of each goes into the shard's gradient (add_split)."""
        if self.grad_full is not None or self.split:
            return
        if split and self.large and self.world_size > 1 and self.shard_grad is None:
            self.split = True
            self.direct = {}
            self.grad_small = torch.empty(self.small_numel, dtype=self.dtype, device=self.device)
            self.holds = [False] * len(self.params)
            return
        # what no gradient fills is zeroed before the reduce-scatter (ready_to_reduce), not here: one pass less
        self.grad_full = torch.empty(self.layout.padded, dtype=self.dtype, device=self.device)
        self.holds = [False] * len(self.params)
        if self.shard_grad is not None:
            seq = monitor.launched()
            with no_python_in_work():
                work = all_gather_into(self.grad_full, self.shard_grad, group)
            monitor.wait(work, seq, f"all-gather of the kept gradients of unit {self.label}")
            self.holds = [p.requires_grad for p in self.params]
            self.shard_grad = None

    def ready_to_reduce(self) -> None:
        """Before a reduce-scatter: the slots of parameters without a gradient in this backward divided too (a
        gradient kept from an earlier backward), and every element nothing filled zeros (the slots of parameters
        that have no gradient, frozen ones, the padding)."""
        if self.split:
            self._ready_split()
            return
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

    def _ready_split(self) -> None:
        """A split backward's ready_to_reduce: zeros for the gradients that did not arrive."""
        with torch.no_grad():
            for i in self.trainable:
                if self.arrived[i] or i in self.direct:
                    continue
                if i in self.small_offsets:
                    assert self.grad_small is not None
                    self.grad_small.narrow(0, self.small_offsets[i], self.params[i].numel()).zero_()
                else:
                    self.direct[i] = torch.zeros(self.params[i].shape, dtype=self.dtype, device=self.device)

    def to_reduce(self) -> list[torch.Tensor]:
        """What a split backward all-reduces, in the same order on every rank: the large parameters' gradients in
        the unit's order, then the small ones' buffer (when there are small ones)."""
        assert self.split and len(self.direct) == len(self.large), "ready_to_reduce() comes first"
        tensors = [self.direct[i] for i in self.large]
        if self.small_numel:
            assert self.grad_small is not None
            tensors.append(self.grad_small)
        return tensors

    def add_split(self) -> None:
        """After a split backward's all-reduces: this rank's part of the unit's flat layout, from each parameter's
        summed gradient (zeros where no gradient goes: frozen parameters, the padding), as the flat buffer's part."""
        lo = self.rank * self.part
        hi = lo + self.part
        part = torch.empty(self.part, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            covered = lo
            for i in sorted(range(len(self.params)), key=lambda i: self.offsets[i]):
                begin, end = max(self.offsets[i], lo), min(self.offsets[i] + self.params[i].numel(), hi)
                if begin >= end:
                    continue
                if begin > covered:
                    part.narrow(0, covered - lo, begin - covered).zero_()
                target = part.narrow(0, begin - lo, end - begin)
                at = begin - self.offsets[i]
                if i in self.direct:
                    target.copy_(self.direct[i].reshape(-1).narrow(0, at, end - begin))
                elif i in self.small_offsets:
                    assert self.grad_small is not None
                    target.copy_(self.grad_small.narrow(0, self.small_offsets[i] + at, end - begin))
                else:
                    target.zero_()  # frozen
                covered = end
            if covered < hi:
                part.narrow(0, covered - lo, hi - covered).zero_()
        self.add_reduced(part)

    def add_reduced(self, part: torch.Tensor) -> None:
        """This rank's part of the reduced gradient (which holds what the unit kept before: see open_grad)."""
        self.shard_grad = part
        self.clear_grads()

    def clear_grads(self) -> None:
        """Drop the gradients of a backward in progress (the whole one, or a split backward's)."""
        self.grad_full = None
        self.holds = [False] * len(self.params)
        self.split = False
        self.direct = {}
        self.grad_small = None

    # -- this rank's pieces -----------------------------------------------------------------------------------

    def pieces(self) -> tuple[Piece, ...]:
        return self.layout.pieces[self.rank]
