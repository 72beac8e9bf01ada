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
- on CPU (gloo) a bucket is all-reduced in place and this rank's part copied out: gloo's own reduce-scatter is that
  all-reduce on a clone of the whole bucket, which its Work holds, so every bucket's clone would live through the
  step and the next backward, above zero1's and ddp's peak; the sums are the same numbers;
- on gloo at two ranks a parameter of :data:`DIRECT_MIN_NUMEL` elements or more, and a quarter of its bucket or more,
  is all-reduced as autograd made its gradient, divided in place (where :func:`~paratrain.sharded.owned.owned`
  shows nothing else refers to it; else a copy), and the bucket's small parameters share a buffer of their own: no
  copy of the whole gradient into fresh pages every backward. A sum of two is the same in any order, so the numbers
  are the flat buffer's; at three ranks and more the one flat buffer stays, as its layout sums in DDP's order;
- at two ranks on gloo the reduce-scatter is an exchange (:meth:`ReduceScatter._start_exchange`): each rank sends
  its peer the peer's half (of the flat buffer, or piece by piece of each large gradient), receives the peer's copy
  of its own half into its part and adds its own: half the bytes of the all-reduce, and no copy of the part out
  of the buffer; the same sums, a sum of two being the same in either order. From the first clip on, the
  all-reduce in place returns, since it measures the whole gradients' norms as it goes;
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
from paratrain.comm.process_groups import keep_forever, no_python_in_work
from paratrain.ddp.bucket_collective import BucketCollective
from paratrain.ddp.buckets import FIRST_BUCKET_BYTES, Bucket
from paratrain.errors import DistributedError
from paratrain.sharded.grad_norm import tensor_norm
from paratrain.sharded.guard import GradientGuard
from paratrain.sharded.owned import owned
from paratrain.sharded.partition import BucketShards, shard_bucket

__all__ = ["DIRECT_MIN_NUMEL", "ReduceScatter", "all_gather_into", "held_at_most", "reduce_scatter_into"]

# a bucket's buffer is taken while launched buckets still hold theirs only within the largest bucket's bytes plus
# DDP's small first bucket: the first bucket (launched early so that communication starts early) then reduces while
# the next one fills, instead of stalling the backward until it is done (3.5 ms a step at the small GPT), and the
# peak rises by at most 1 MiB. Two large buckets at once put zero2's peak during backward above zero1's at the
# 53.6M MLP
SMALL_IN_FLIGHT_BYTES = FIRST_BUCKET_BYTES
# at two ranks on gloo, a parameter of at least this many elements and a quarter of its bucket or more is all-reduced
# as autograd made its gradient (divided in place), not copied into the bucket's flat buffer: the copy, into pages
# that fault in every backward (the buffer is freed between backwards), cost zero2 about a tenth of a step against
# zero1 at the 10M MLP. Smaller shares save less than a collective of their own costs (a small GPT's blocks, each a
# few percent of a bucket, were 3% slower reduced one by one)
DIRECT_MIN_NUMEL = 1 << 16
# the tags of zero2's exchanges (two ranks, gloo): a range of their own, each operation's the monitor's number above it
TAG_BASE = 1 << 28


def held_at_most(sizes: Sequence[int]) -> int:
    """The most bytes of bucket buffers held at once during a backward, given each bucket's buffer bytes."""
    return min(sum(sizes), max(sizes, default=0) + SMALL_IN_FLIGHT_BYTES)


def reduce_scatter_into(output: torch.Tensor, buffer: torch.Tensor, group: Any) -> Any:
    """Start the sum of every rank's ``buffer`` into each rank's ``output`` (its part): the Work."""
    single = getattr(dist, "reduce_scatter_single", None)  # torch's newer name; reduce_scatter_tensor before
    start = single if single is not None else dist.reduce_scatter_tensor
    return start(output, buffer, group=group, async_op=True)


def all_gather_into(buffer: torch.Tensor, part: torch.Tensor, group: Any) -> Any:
    """Start gathering every rank's ``part`` into ``buffer`` (``part`` may be this rank's slice of it): the Work."""
    single = getattr(dist, "all_gather_single", None)  # torch's newer name; all_gather_into_tensor before
    start = single if single is not None else dist.all_gather_into_tensor
    return start(buffer, part, group=group, async_op=True)


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
        self.rank = dist.get_rank(group)
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
        # gloo's reduce-scatter clones the whole input and all-reduces the clone, which the Work keeps (and the
        # reducer keeps each Work a step): CPU buckets are all-reduced in place and this rank's part copied out
        self.in_place = all(b.device.type == "cpu" for b in self.buckets) or dist.get_backend(group) == "gloo"
        # at two ranks on gloo, each bucket's large parameters are reduced as tensors of their own (``direct``), its
        # small ones in a flat buffer of their own (``small_at``: each one's offset in it); a sum of two is the same
        # in any order, so the numbers are the flat buffer's. Elsewhere every bucket keeps its one flat buffer, whose
        # layout is DDP's order of summation at three ranks and more
        split = self.pairwise = self.in_place and self.world_size == 2
        self.large = [False] * len(self.params)
        for bucket in self.buckets:
            for i in bucket.indices:
                numel = self.params[i].numel()
                self.large[i] = split and numel >= DIRECT_MIN_NUMEL and 4 * numel >= bucket.numel
        self.small_at: dict[int, int] = {}
        self.small_numel = [0] * len(self.buckets)
        for b, bucket in enumerate(self.buckets):
            if any(self.large[i] for i in bucket.indices):
                for i in bucket.indices:
                    if not self.large[i]:
                        self.small_at[i] = self.small_numel[b]
                        self.small_numel[b] += self.params[i].numel()
        self.split = [any(self.large[i] for i in bucket.indices) for bucket in self.buckets]
        self.direct: dict[int, torch.Tensor] = {}  # a large parameter's summed-to-be gradient, this backward
        self._extra_works: dict[int, list[tuple[Any, int]]] = {}  # a split bucket's collectives beyond its first
        self._unfinished: list[int] = []  # launched buckets whose buffer is still held, oldest first
        # the most each bucket holds (its padded buffer, or its large parameters' gradients and small ones' buffer)
        self._bytes = [s.padded * b.dtype.itemsize for s, b in zip(self.shards, self.buckets, strict=True)]
        self._budget = held_at_most(self._bytes)
        self._works: dict[int, tuple[Any, int]] = {}  # each unfinished bucket's Work and collective number
        # between a synchronised backward and the next forward, a reduced parameter's .grad is a placeholder
        # whose use raises, naming par.clip_grad_norm_ (torch's own clip would otherwise read None: 0.0)
        self.guard = GradientGuard("zero2")
        # each parameter's whole-gradient norm, torch's number (par.clip_grad_norm_): from the first clip on, measured
        # while its bucket is whole (all-reduced in place), else gathered back for it; valid while the bucket's part
        # is unchanged since (its version counter: an unscale or a clip changes it)
        self.norm_type: float | None = None
        self._norms: dict[int, torch.Tensor] = {}
        self._measured: dict[int, int] = {}  # bucket -> its part's version when its norms were measured

    # -- buffers that come and go -----------------------------------------------------------------------------

    def _ensure(self, b: int) -> None:
        """Bucket ``b``'s buffer, taken now if it has none (after the oldest launched bucket is done, if need be)."""
        if self.buffers[b].numel() or not self.buckets[b].numel:
            return
        self._make_room(b)
        bucket, shards = self.buckets[b], self.shards[b]
        if self.split[b]:  # the small parameters' own buffer (none: the bucket is all large parameters)
            if not self.small_numel[b]:
                return
            buffer = torch.empty(self.small_numel[b], dtype=bucket.dtype, device=bucket.device)
            self.buffers[b] = buffer
            for i, at in self.small_at.items():
                if self.bucket_of[i] == b:
                    p = self.params[i]
                    self.views[i] = buffer.narrow(0, at, p.numel()).view_as(p)
            return
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
            grad = self.direct.pop(i, None)
            if finished and grad is not None:
                grad.untyped_storage().resize_(0)  # ours (owned, or our copy): freed now, not with the Work
        if b in self._unfinished:
            self._unfinished.remove(b)
        self._works.pop(b, None)
        extra = self._extra_works.pop(b, [])
        if not finished:  # a send or receive dropped in flight must not be freed while gloo may still touch it
            keep_forever(*(work for work, _ in extra))

    def copy_in(self, index: int, grad: torch.Tensor) -> None:
        if self.large[index]:
            self._take_direct(index, grad)
        else:
            self._ensure(self.bucket_of[index])
            super().copy_in(index, grad)
        self.params[index].grad = None  # the bucket holds it now; only this rank's part is kept after the sum

    def _take_direct(self, index: int, grad: torch.Tensor) -> None:
        """A large parameter's gradient, divided: autograd's own tensor, in place, where nothing else refers to it or
        its bytes (``grad``, this method's and ``copy_in``'s arguments and the reducer's local hold it); else a copy."""
        if grad.is_sparse:
            super().copy_in(index, grad)  # raises: DDP averages dense buckets only
        if grad.requires_grad:
            grad = grad.detach()
        b = self.bucket_of[index]
        if not any(self.direct.get(i) is not None for i in self.buckets[b].indices) and not self.buffers[b].numel():
            self._make_room(b)  # the bucket's first gradient: as _ensure bounds buffers
        p = self.params[index]
        if grad.dtype == p.dtype and grad.device == p.device and owned(grad, holders=4):
            self.direct[index] = grad.div_(self.divisor) if self.divisor > 1 else grad
            return
        slot = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        if grad.dtype == p.dtype:
            torch.div(grad, self.divisor, out=slot)
        else:
            slot.copy_(grad).div_(self.divisor)
        self.direct[index] = slot

    def zero_slot(self, index: int) -> None:
        if self.large[index]:
            p = self.params[index]
            self.direct[index] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            return
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
            with no_python_in_work():
                work = all_gather_into(whole, self.grads[b], self.group)
            gathers.append((b, whole, work, seq))
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
        if self.exchanges:
            return self._start_exchange(b, seq)
        if self.split[b]:
            return self._start_split(b, seq)
        if self.in_place:
            work = dist.all_reduce(self.buffers[b], group=self.group, async_op=True)
        else:
            work = reduce_scatter_into(self.grads[b], self.buffers[b], self.group)
        self._unfinished.append(b)
        self._works[b] = (work, seq)
        return work

    def _start_split(self, b: int, seq: int) -> Any:
        """All-reduce each large parameter's gradient, then the small ones' buffer: the first collective is the
        reducer's (``seq``), each further one numbered by the monitor, so every rank numbers them alike."""
        tensors = [self.direct[i] for i in self.buckets[b].indices if self.large[i]]
        if self.small_numel[b]:
            tensors.append(self.buffers[b])
        works = []
        for n, tensor in enumerate(tensors):
            number = seq if n == 0 else self.monitor.launched()
            works.append((dist.all_reduce(tensor, group=self.group, async_op=True), number))
        self._unfinished.append(b)
        self._works[b] = works[0]
        self._extra_works[b] = works[1:]
        return works[0][0]

    @property
    def exchanges(self) -> bool:
        """Whether this backward's buckets are reduce-scattered by exchanging halves with the peer: at two ranks on
        gloo, until a clip asks for whole-gradient norms (which the in-place all-reduce measures as it goes)."""
        return self.pairwise and self.norm_type is None

    def _start_exchange(self, b: int, seq: int) -> Any:
        """Reduce-scatter bucket ``b`` between two ranks: send the peer its half, receive this rank's half of the
        peer's gradients into this rank's part (the sum is completed by adding this rank's own: a sum of two is
        the same in either order, so the numbers are the all-reduce's). Half the bytes an all-reduce moves, and
        no copy of the part out of the buffer. A split bucket's large parameters are exchanged tensor by tensor,
        piece by piece; its small ones' buffer is all-reduced. Every rank issues the same operations in the same
        order, the first numbered ``seq``, the others by the monitor; each send and receive is tagged with its
        number, so that the peer's matching operation is the one with the same number."""
        ops: list[tuple[torch.Tensor, int | None]] = []  # (tensor, peer to send it to; None: receive into it)
        part = self.shards[b].part
        if self.split[b]:
            bucket = self.buckets[b]
            for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                if not self.large[i]:
                    continue
                flat = self.direct[i].view(-1)
                for r in range(2):
                    lo, hi = max(offset, r * part), min(offset + flat.numel(), (r + 1) * part)
                    if lo < hi:
                        if r == self.rank:
                            ops.append((self.grads[b].narrow(0, lo - r * part, hi - lo), None))
                        else:
                            ops.append((flat.narrow(0, lo - offset, hi - lo), r))
        else:
            for r in range(2):
                if r == self.rank:
                    ops.append((self.grads[b], None))
                else:
                    ops.append((self.buffers[b].narrow(0, r * part, part), r))
        works = []
        peer = dist.get_global_rank(self.group, 1 - self.rank) if self.group is not None else 1 - self.rank
        for n, (tensor, to) in enumerate(ops):
            number = seq if n == 0 else self.monitor.launched()
            if to is None:
                work = dist.irecv(tensor, src=peer, group=self.group, tag=TAG_BASE + number)
            else:
                work = dist.isend(tensor, dst=peer, group=self.group, tag=TAG_BASE + number)
            works.append((work, number))
        if self.split[b] and self.small_numel[b]:
            number = seq if not works else self.monitor.launched()
            works.append((dist.all_reduce(self.buffers[b], group=self.group, async_op=True), number))
        # gloo's send and receive Works must be waited for once (a second wait never returns), and the reducer waits
        # for the handle it is given: it gets one already complete, and every operation is waited for once, by
        # _finish (the handle's number is the first operation's)
        handle: Any = torch.futures.Future()
        handle.set_result(None)
        self._unfinished.append(b)
        self._works[b] = (handle, seq)
        self._extra_works[b] = works
        return handle

    def _settle(self, b: int) -> None:
        """Wait for bucket ``b``'s reduce-scatter and give its buffer back."""
        work, seq = self._works[b]
        self.monitor.wait(work, seq, f"gradient reduce-scatter of bucket {b}")
        self._finish(b)

    def done(self, b: int, result: Any) -> None:
        if b in self._works:
            self._finish(b)  # waited for by the reducer: the buffer is free

    def _finish(self, b: int) -> None:
        """Bucket ``b``'s collective is done: this rank's part kept (from the all-reduced buffer), the buffer freed."""
        for work, seq in self._extra_works.get(b, []):
            self.monitor.wait(work, seq, f"gradient reduce-scatter of bucket {b}")
        if self.exchanges:
            self._add_own_half(b)
        elif self.in_place:
            if self.split[b]:
                self._keep_part_split(b)
            else:
                part = self.shards[b].part
                self.grads[b].copy_(self.buffers[b].narrow(0, self.rank * part, part))
            if self.norm_type is not None:
                self._measure(b, self.norm_type)
        self._release(b, finished=True)

    def _summed(self, b: int, i: int) -> torch.Tensor:
        """Parameter ``i``'s all-reduced gradient (bucket ``b``), flat: its own tensor, or its slot in a buffer."""
        if self.large[i]:
            return self.direct[i].view(-1)
        if self.split[b]:
            return self.buffers[b].narrow(0, self.small_at[i], self.params[i].numel())
        offset = self.buckets[b].offsets[self.buckets[b].indices.index(i)]
        return self.buffers[b].narrow(0, offset, self.params[i].numel())

    def _add_own_half(self, b: int) -> None:
        """Complete an exchanged bucket's sum in this rank's part: the peer's half received there, plus this rank's
        own (a split bucket's small parameters: from their all-reduced buffer)."""
        part = self.grads[b]
        if not self.split[b]:
            part.add_(self.buffers[b].narrow(0, self.rank * self.shards[b].part, self.shards[b].part))
            return
        for piece in self.shards[b].pieces[self.rank]:
            target = part.narrow(0, piece.offset, piece.length)
            if self.large[piece.param]:
                target.add_(self.direct[piece.param].view(-1).narrow(0, piece.start, piece.length))
            else:
                target.copy_(self._summed(b, piece.param).narrow(0, piece.start, piece.length))

    def _keep_part_split(self, b: int) -> None:
        """This rank's part of a split bucket, piece by piece from the parameters' sums (its padding stays 0)."""
        part = self.grads[b]
        for piece in self.shards[b].pieces[self.rank]:
            summed = self._summed(b, piece.param).narrow(0, piece.start, piece.length)
            part.narrow(0, piece.offset, piece.length).copy_(summed)

    # -- each parameter's whole-gradient norm ---------------------------------------------------------------------

    def _measure(self, b: int, norm_type: float, whole: torch.Tensor | None = None) -> None:
        """The norms of bucket ``b``'s parameters, from their sums: ``whole`` (the bucket gathered back, every rank's
        part), or what its collective summed."""
        bucket = self.buckets[b]
        for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
            p = self.params[i]
            summed = self._summed(b, i) if whole is None else whole.narrow(0, offset, p.numel())
            self._norms[i] = tensor_norm(summed.view_as(p), norm_type)
        self._measured[b] = self.grads[b]._version

    def _forget_norms(self) -> None:
        self._norms, self._measured = {}, {}

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
            work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
            self.monitor.wait(work, seq, "all-reduce of whether the gradient norms were measured")
            fresh = bool(flag.item())
        if not fresh:
            self._forget_norms()
            for b in wanted:
                bucket = self.buckets[b]
                whole = torch.empty(self.shards[b].padded, dtype=bucket.dtype, device=bucket.device)
                seq = self.monitor.launched()
                with no_python_in_work():
                    work = all_gather_into(whole, self.grads[b], self.group)
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
