"""zero2's bucket collective: each bucket reduce-scattered during backward, each rank keeping only its part.

    reducer = Reducer(params, names, ..., collective=ReduceScatter)    # what ZeroDataParallel(model, stage=2) builds
    reducer.collective.grads[0]                                       # this rank's part of bucket 0's sum

The buckets, their launch order, the states of an iteration, unused parameters and reentrant backwards are the
DDP reducer's (:mod:`paratrain.ddp.reducer`, which calls this collective as it calls DDP's all-reduce,
:mod:`paratrain.ddp.bucket_collective`); what differs is where gradients go:

- a bucket's flat buffer exists only while the bucket fills and its reduce-scatter runs: it is taken when the
  bucket's first gradient arrives and freed once its collective is done (its storage emptied at once: the Work the
  reducer keeps for a step must not keep the bytes); a new buffer is taken once the launched buckets' buffers
  and it fit in the largest bucket's bytes plus :data:`SMALL_IN_FLIGHT_BYTES` (the oldest are waited for until
  they do: :func:`held_at_most`), so the full gradient never exists at once;
- the sum is :class:`~paratrain.comm.ops.GroupOps`'s reduce-scatter (on gloo an all-reduce in place with this
  rank's part copied out, the whole sum in the buffer until then: each parameter's norm is measured there once a
  clip asked for norms);
- each parameter's gradient is copied in (divided by the world size, as DDP divides it) and its ``.grad`` freed
  at once; inside ``no_sync`` gradients accumulate in ``.grad`` as under DDP, and the synchronising backward
  copies the sum;
- the reduce-scatter sums every rank's buffer into each rank's part, :attr:`ReduceScatter.grads` (the padded
  part of each bucket, kept from step to step): the gradients of this rank's pieces of the parameters
  (:mod:`paratrain.sharded.partition`).

Gradients add up from backward to backward until ``zero_grad``, as DDP's ``.grad`` do. Inside ``no_sync``
(``Parallel.accumulate``, the cheap way) ``.grad`` holds them, and the synchronising backward reduces the sum.
Across synchronised backwards (``backward(); backward(); step()``, every one reducing) the parts are kept between
them, and the next backward first all-gathers them back into ``.grad`` (at the outputs' gradient, before autograd
adds anything; a forward inside ``no_sync`` does it at once), so autograd adds the new gradients to the reduced ones
exactly as under DDP: the same numbers, bit for bit at two ranks. That costs an all-gather of every bucket, and the
whole gradient on every rank while that backward runs; a reduce-scatter added to the kept parts instead would
round differently from DDP (1e-5 relative in AdamW's parameters after 3 steps). ``zero_grad(set_to_none=False)``
zeroes the parts, which need no gathering: a backward onto zeros gives what one onto nothing gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.ops import GroupOps, Reduction
from paratrain.ddp.bucket_collective import BucketCollective
from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, Bucket
from paratrain.errors import DistributedError
from paratrain.sharded.grad_norm import tensor_norm
from paratrain.sharded.guard import GradientGuard
from paratrain.sharded.partition import BucketShards, shard_bucket

__all__ = ["ReduceScatter", "held_at_most"]

# a bucket's buffer is taken while launched buckets still hold theirs only within the largest bucket's bytes plus
# DDP's small first bucket: the first bucket (launched early so that communication starts early) then reduces while
# the next one fills, instead of stalling the backward until it is done (3.5 ms a step at the small GPT), and the
# peak rises by at most 1 MiB. Two large buckets at once put zero2's peak during backward above zero1's at the
# 53.6M MLP
SMALL_IN_FLIGHT_BYTES = FIRST_BUCKET_BYTES


def held_at_most(sizes: Sequence[int]) -> int:
    """The most bytes of bucket buffers held at once during a backward, given each bucket's buffer bytes."""
    return min(sum(sizes), max(sizes, default=0) + SMALL_IN_FLIGHT_BYTES)


class ReduceScatter(BucketCollective):
    """Bucketed, overlapped reduce-scatter of gradients: this rank keeps its part of each bucket's sum."""

    name: ClassVar[str] = "reduce-scatter"
    label: ClassVar[str] = "reduce_scatter"

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        buckets: Sequence[Bucket],
        *,
        group: Any,
        monitor: CollectiveMonitor,
    ) -> None:
        super().__init__(params, names, buckets, group=group, monitor=monitor)
        self.ops = GroupOps(group, self.buckets[0].device if self.buckets else "cpu")
        self.rank = self.ops.rank
        numels = [p.numel() for p in self.params]
        self.shards: list[BucketShards] = [shard_bucket(b, numels, self.world_size) for b in self.buckets]
        # this rank's part of each bucket's summed gradient: its pieces' gradients, kept between steps
        self.grads = [
            torch.zeros(s.part, dtype=b.dtype, device=b.device) for s, b in zip(self.shards, self.buckets, strict=True)
        ]
        self.reduced = [False] * len(self.params)  # parameter i has a gradient in the parts (None if not)
        self.held = False  # the parts hold gradients that the next backward adds to: gathered into .grad first
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.indices}
        # while a bucket has no buffer, an empty one of its own dtype and device stands in (and in its views)
        self._placeholders = [torch.empty(0, dtype=b.dtype, device=b.device) for b in self.buckets]
        self.buffers = list(self._placeholders)
        self.views = [self._placeholders[self.bucket_of[i]] for i in range(len(self.params))]
        self._unfinished: list[int] = []  # launched buckets whose buffer is still held, oldest first
        self._bytes = [s.padded * b.dtype.itemsize for s, b in zip(self.shards, self.buckets, strict=True)]
        self._budget = held_at_most(self._bytes)
        self._reductions: dict[int, tuple[Reduction, int]] = {}  # each unfinished bucket's and its number
        # between a synchronised backward and the next forward, a reduced parameter's .grad is a placeholder
        # whose use raises, naming par.clip_grad_norm_ (torch's own clip would otherwise read None: 0.0)
        self.guard = GradientGuard("zero2")
        # each parameter's whole-gradient norm, torch's number (par.clip_grad_norm_): from the first clip on, measured
        # while its bucket's sum is whole (the reduce-scatter is an all-reduce in place), else gathered back for it;
        # valid while the bucket's part is unchanged since (its version counter: an unscale or a clip changes it)
        self.norm_type: float | None = None
        self._norms: dict[int, torch.Tensor] = {}
        self._measured: dict[int, int] = {}  # bucket -> its part's version when its norms were measured

    @property
    def in_place(self) -> bool:
        """Whether each bucket's whole sum is in its buffer before this rank's part is kept (gloo)."""
        return self.ops.reduces_in_place

    # -- buffers that come and go -----------------------------------------------------------------------------

    def _ensure(self, b: int) -> None:
        """Bucket ``b``'s buffer, taken now if it has none (after the oldest launched bucket is done, if need be)."""
        if self.buffers[b].numel() or not self.buckets[b].numel:
            return
        self._make_room(b)
        bucket, shards = self.buckets[b], self.shards[b]
        buffer = torch.empty(shards.padded, dtype=bucket.dtype, device=bucket.device)
        buffer[bucket.numel :].zero_()  # the padding; every parameter's slot is written by its copy-in
        self.buffers[b] = buffer
        for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
            p = self.params[i]
            self.views[i] = buffer.narrow(0, offset, p.numel()).view_as(p)

    def _make_room(self, b: int) -> None:
        """Wait for the oldest launched buckets until bucket ``b`` fits beside the rest within the budget."""
        while self._unfinished and sum(self._bytes[u] for u in self._unfinished) + self._bytes[b] > self._budget:
            self._settle(self._unfinished[0])

    def _release(self, b: int, *, finished: bool) -> None:
        """Give bucket ``b``'s buffer back: its placeholder stands in again.

        ``finished``: its collective was waited for, so its memory is freed now (the storage emptied), not when the
        Work that the reducer keeps until the next step ends lets go of it (a Work holds its tensors: the whole
        gradient, every bucket of it, would stay alive through the step and the next backward)."""
        empty = self._placeholders[b]
        if finished:
            self.buffers[b].untyped_storage().resize_(0)
        self.buffers[b] = empty
        for i in self.buckets[b].indices:
            self.views[i] = empty
        if b in self._unfinished:
            self._unfinished.remove(b)
        self._reductions.pop(b, None)

    def copy_in(self, index: int, grad: torch.Tensor) -> None:
        self._ensure(self.bucket_of[index])
        super().copy_in(index, grad)
        self.params[index].grad = None  # the bucket holds it now; only this rank's part is kept after the sum

    def zero_slot(self, index: int) -> None:
        self._ensure(self.bucket_of[index])
        super().zero_slot(index)

    def prepare(self, sync: bool) -> None:
        self.guard.disarm(self.params)  # autograd may add to .grad again
        self._forget_norms()
        # what a backward that failed half-way left behind (the next forward starts clean)
        for b in list(self._unfinished):
            self._release(b, finished=False)  # its collective may still read the buffer: only dropped
        if not sync and self.held:
            self._restore()  # inside no_sync autograd adds to .grad from the first gradient on

    # -- gradients that add up across synchronised backwards -------------------------------------------------

    def backward_started(self) -> None:
        self.guard.disarm(self.params)
        self._forget_norms()
        if self.held:
            self._restore()  # before autograd adds this backward's gradients (but the first, added to)

    def _restore(self) -> None:
        """All-gather the kept parts into ``.grad``, as DDP holds them after a synchronised backward."""
        self.held = False
        gathers = []
        for b, (bucket, shards) in enumerate(zip(self.buckets, self.shards, strict=True)):
            if not any(self.reduced[i] for i in bucket.indices):
                continue  # the same on every rank: reduced follows the used map, summed across ranks
            whole = torch.empty(shards.padded, dtype=bucket.dtype, device=bucket.device)
            seq = self.monitor.launched()
            gathers.append((b, whole, self.ops.all_gather(whole, self.grads[b]), seq))
        with torch.no_grad():
            for b, whole, work, seq in gathers:
                self.monitor.wait(work, seq, f"all-gather of the gradients kept since the last step, bucket {b}")
                bucket = self.buckets[b]
                for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                    p = self.params[i]
                    if self.reduced[i]:
                        kept = whole.narrow(0, offset, p.numel()).view_as(p)
                        p.grad = kept if p.grad is None else p.grad.add_(kept)

    # -- the collectives ----------------------------------------------------------------------------------------

    def start(self, b: int, seq: int) -> Any:
        self._ensure(b)
        reduction = self.ops.reduce_scatter(self.grads[b], self.buffers[b])
        self._unfinished.append(b)
        self._reductions[b] = (reduction, seq)
        return reduction.work

    def _settle(self, b: int) -> None:
        """Wait for bucket ``b``'s reduce-scatter and give its buffer back."""
        reduction, seq = self._reductions[b]
        self.monitor.wait(reduction.work, seq, f"gradient reduce-scatter of bucket {b}")
        self._finish(b)

    def done(self, b: int, result: Any) -> None:
        if b in self._reductions:
            self._finish(b)  # waited for by the reducer: the buffer is free

    def _finish(self, b: int) -> None:
        """Bucket ``b``'s collective is done: this rank's part kept, its norms measured from a whole sum, the buffer
        freed."""
        reduction, _ = self._reductions[b]
        reduction.finish()
        if self.norm_type is not None and reduction.whole is not None:
            self._measure(b, self.norm_type, reduction.whole)
        self._release(b, finished=True)

    # -- each parameter's whole-gradient norm ---------------------------------------------------------------------

    def _measure(self, b: int, norm_type: float, whole: torch.Tensor) -> None:
        """The norms of bucket ``b``'s parameters, from ``whole``: the bucket's sum, every rank's part."""
        bucket = self.buckets[b]
        for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
            p = self.params[i]
            self._norms[i] = tensor_norm(whole.narrow(0, offset, p.numel()).view_as(p), norm_type)
        self._measured[b] = self.grads[b]._version

    def _forget_norms(self) -> None:
        self._norms, self._measured = {}, {}

    def norms_unscaled(self, indices: Sequence[int], inv_scale: torch.Tensor) -> None:
        """The gradient scaler unscaled this rank's parts of parameters ``indices``: their norms measured during
        backward, from the scaled sums, are scaled alike (a power of 2: the same float as the norm of the unscaled
        gradient). Norms not measured yet are measured later from the parts, unscaled by then."""
        for i in indices:
            norm = self._norms.get(i)
            if norm is not None:
                self._norms[i] = norm * inv_scale.to(norm.device)

    def whole_norms(self, norm_type: float) -> dict[int, torch.Tensor]:
        """Every reduced parameter's whole-gradient norm, torch's number for its ``.grad`` under DDP (a collective).

        Measured during backward where buckets are all-reduced whole (CPU, gloo) once a norm was asked for; else,
        and for the first step, each bucket is gathered back whole, one at a time, and measured.
        """
        wanted = [b for b, bucket in enumerate(self.buckets) if any(self.reduced[i] for i in bucket.indices)]
        fresh = (
            self.in_place
            and norm_type == self.norm_type
            and all(self._measured.get(b) == self.grads[b]._version for b in wanted)
        )
        if self.in_place:  # every rank measures, or every rank gathers
            flag = torch.tensor([int(fresh)], dtype=torch.int32)
            seq = self.monitor.launched()
            work = self.ops.all_reduce(flag, op=dist.ReduceOp.MIN)
            self.monitor.wait(work, seq, "all-reduce of whether the gradient norms were measured")
            fresh = bool(flag.item())
        if not fresh:
            self._forget_norms()
            for b in wanted:
                bucket = self.buckets[b]
                whole = torch.empty(self.shards[b].padded, dtype=bucket.dtype, device=bucket.device)
                seq = self.monitor.launched()
                work = self.ops.all_gather(whole, self.grads[b])
                self.monitor.wait(work, seq, f"all-gather of bucket {b}'s gradients for their norm")
                self._measure(b, norm_type, whole)
                del whole
        self.norm_type = norm_type  # measured as each bucket is reduced from the next backward on
        return {i: n for i, n in self._norms.items() if self.reduced[i]}

    def write_back(self, used: list[int] | None) -> None:
        # every bucket was waited for and given back (done): no rank holds a whole gradient afterwards
        # a parameter unused on every rank keeps what it had (zeros, or what it was gathered back with)
        self.reduced = [used is None or used[i] != 0 or self.reduced[i] for i in range(len(self.params))]
        self.held = any(self.reduced)
        for p in self.params:
            p.grad = None
        self.guard.arm(p for p, reduced in zip(self.params, self.reduced, strict=True) if reduced)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear this rank's gradients: gone (``set_to_none``), or zeros that the next backward adds to."""
        self.held = False
        self._forget_norms()
        if set_to_none:
            self.reduced = [False] * len(self.params)
            return
        for g in self.grads:
            g.zero_()

    def reducible_outside_backward(self) -> None:
        raise DistributedError(
            "zero2 reduces its gradients during backward only (a bucket's buffer exists while backward fills it): "
            "join() and reducing the buckets outside backward are not supported; give every rank the same number "
            "of batches"
        )
