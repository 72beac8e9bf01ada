"""How the reducer's buckets are summed across ranks, and where the sums go: its bucket collective.

    collective = functools.partial(AllReduce, grad_as_view=True)        # ddp, zero1
    reducer = Reducer(params, names, group=group, monitor=monitor, bucket_cap_bytes=cap, collective=collective, ...)
    reducer.collective.buffers[0]                                       # bucket 0's flat buffer

The :class:`~paratrain.ddp.reducer.Reducer` decides when: the hooks, which parameters are ready, the order buckets
launch in, the waits, unused parameters, static graphs. Its collective, built by the reducer over the parameters
and buckets (a :data:`CollectiveFactory`), decides what: where each bucket's flat buffer lives, how a rank's
gradient enters it, which collective sums it, and what the parameters hold afterwards. :class:`AllReduce` keeps
a buffer per bucket, all-reduces it in place (or hands it to a communication hook) and writes the averages into
``.grad``; :class:`~paratrain.sharded.reducer.ReduceScatter` (zero2) holds a buffer only while its bucket fills and
reduce-scatters it into this rank's part. The reducer calls a collective once per gradient (:meth:`copy_in`,
:meth:`zero_slot`), once per bucket (:meth:`start`, :meth:`done`) and otherwise once per forward or backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.ddp.buckets import Bucket
from paratrain.ddp.comm_hooks import CommHook, GradBucket
from paratrain.errors import DistributedError

__all__ = ["AllReduce", "BucketCollective", "CollectiveFactory"]


class BucketCollective:
    """What sums the buckets of one reducer: their buffers, the copy of gradients in, the collective, the results.

    Subclasses allocate :attr:`buffers` and :attr:`views` and implement :meth:`start` and :meth:`write_back`.
    """

    name: ClassVar[str] = "collective"  # in the messages of waits and timeouts: "gradient all-reduce of bucket 0"
    label: ClassVar[str] = "collective"  # in profiler ranges: paratrain::DistributedDataParallel.all_reduce

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        buckets: Sequence[Bucket],
        *,
        group: Any,
        monitor: CollectiveMonitor,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.buckets = list(buckets)
        self.group = group
        self.monitor = monitor
        self.world_size = monitor.world_size
        # what copy_in divides by: the world size, or under join(divide_by_initial_world_size=False) the ranks
        # active in this iteration
        self.divisor = self.world_size
        self.averages = True  # copy_in divides (the built-in average); a communication hook gets the plain sum
        self.grad_as_view = False  # each .grad becomes a view of its slot (gradient_as_bucket_view)
        # each bucket's flat buffer, and each parameter's slot in it shaped like the parameter
        self.buffers: list[torch.Tensor] = []
        self.views: list[torch.Tensor] = []

    # -- once per gradient --------------------------------------------------------------------------------------

    def copy_in(self, index: int, grad: torch.Tensor) -> None:
        """Put this rank's gradient of parameter ``index`` into its bucket slot, divided for the average."""
        if grad.is_sparse:
            raise DistributedError(
                f"parameter {self.names[index]!r} has a sparse gradient; DistributedDataParallel averages dense "
                f"buckets only: use a dense Embedding (sparse=False) under DDP"
            )
        view = self.views[index]
        divide = self.averages and self.divisor > 1
        if grad is view:
            if divide:
                view.div_(self.divisor)
            return
        if grad.requires_grad:
            grad = grad.detach()  # backward(create_graph=True): the values go into the bucket, not the graph
        if divide:
            torch.div(grad, self.divisor, out=view)
        else:
            view.copy_(grad)
        if self.grad_as_view:
            self.params[index].grad = view  # from now on autograd accumulates straight into the bucket

    def zero_slot(self, index: int) -> None:
        """Parameter ``index`` takes part in this backward with zeros (no gradient, none accumulated)."""
        self.views[index].zero_()

    # -- once per bucket ----------------------------------------------------------------------------------------

    def start(self, b: int, seq: int) -> Any:
        """Start summing bucket ``b`` (collective number ``seq`` of the monitor): a Work or a future."""
        raise NotImplementedError

    def done(self, b: int, result: Any) -> None:
        """Bucket ``b``'s collective finished (waited for), with what the wait returned."""

    def write_bucket(self, b: int, used: list[int] | None) -> None:
        """Bucket ``b`` was waited for: give its parameters their results now, while later buckets are still in
        flight (``used`` as for :meth:`write_back`). A collective that can only finish all together does it in
        :meth:`write_back`."""

    # -- once per forward or backward ---------------------------------------------------------------------------

    def prepare(self, sync: bool) -> None:
        """A forward ran: the next backward synchronises (``sync``) or stays local (inside ``no_sync``)."""

    def backward_started(self) -> None:
        """A synchronised backward started (its outputs' gradient, or its first parameter's)."""

    def write_back(self, used: list[int] | None) -> None:
        """Every bucket was waited for: give the parameters the results. ``used``: how many ranks used each
        parameter since the last synchronisation (None: all did)."""
        raise NotImplementedError

    def reducible_outside_backward(self) -> None:
        """Raise unless the buffers can be reduced outside backward as they are (a joined rank, benchmarks)."""


class CollectiveFactory(Protocol):
    """What builds a reducer's collective over its parameters and buckets: a class, or a partial of one."""

    def __call__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        buckets: Sequence[Bucket],
        *,
        group: Any,
        monitor: CollectiveMonitor,
    ) -> BucketCollective: ...


class AllReduce(BucketCollective):
    """Each bucket all-reduced in place (DDP's average; zero1's), or by a registered communication hook.

    Args:
        grad_as_view: the averages stay in the buckets and each ``.grad`` is a view of its slot (torch's
            ``gradient_as_bucket_view``); otherwise they are copied into ``.grad``.
    """

    name: ClassVar[str] = "all-reduce"
    label: ClassVar[str] = "all_reduce"

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        buckets: Sequence[Bucket],
        *,
        group: Any,
        monitor: CollectiveMonitor,
        grad_as_view: bool = False,
    ) -> None:
        super().__init__(params, names, buckets, group=group, monitor=monitor)
        self.grad_as_view = grad_as_view
        # None: the built-in average, which divides while copying gradients in (one pass, as torch's reducer
        # does) and then sums with a plain all-reduce; a registered hook gets the undivided buffer instead
        self.hook: CommHook | None = None
        self.hook_state: Any = group
        # a zeroed buffer per bucket, kept from step to step (every parameter is in one)
        slots = {}
        for bucket in self.buckets:
            self.buffers.append(buffer := torch.zeros(bucket.numel, dtype=bucket.dtype, device=bucket.device))
            for i, offset in zip(bucket.indices, bucket.offsets, strict=True):
                slots[i] = buffer.narrow(0, offset, self.params[i].numel()).view_as(self.params[i])
        self.views = [slots[i] for i in range(len(self.params))]

    def register_hook(self, state: Any, hook: CommHook) -> None:
        """Replace the all-reduce of each bucket by ``hook(state, bucket)``, which gets the undivided buffer."""
        self.hook, self.hook_state = hook, state
        self.averages = False

    def start(self, b: int, seq: int) -> Any:
        if self.hook is None:
            return dist.all_reduce(self.buffers[b], group=self.group, async_op=True)
        bucket = self.buckets[b]
        grad_bucket = GradBucket(
            b,
            self.buffers[b],
            [self.params[i] for i in bucket.indices],
            [self.views[i] for i in bucket.indices],
            b == len(self.buckets) - 1,
            self.world_size,
        )
        return self.hook(self.hook_state, grad_bucket)

    def done(self, b: int, result: Any) -> None:
        # None: a plain all-reduce, in place; a hook's future gives the averaged bucket
        if isinstance(result, list) and len(result) == 1:
            result = result[0]  # hooks written for torch < 1.9 return a list of one tensor
        if isinstance(result, torch.Tensor) and result is not self.buffers[b]:
            self.buffers[b].copy_(result)

    def write_bucket(self, b: int, used: list[int] | None) -> None:
        # each bucket's averages go into .grad as soon as it is waited for, overlapping the copies with the later
        # buckets' all-reduces (torch's reducer finalizes bucket by bucket too)
        for i in self.buckets[b].indices:
            if used is not None and used[i] == 0:
                continue  # unused on every rank: the gradient stays what it was (None after zero_grad)
            p = self.params[i]
            view = self.views[i]
            if self.grad_as_view or p.grad is None:
                p.grad = view if self.grad_as_view else view.clone()
            elif p.grad is not view:
                p.grad.copy_(view)

    def write_back(self, used: list[int] | None) -> None:
        """Nothing left: every bucket was written as it finished (:meth:`write_bucket`)."""
