"""The gradient reducer: averages gradients across ranks in buckets, overlapped with backward.

Each parameter's post-accumulate-grad hook copies its gradient into its bucket's flat buffer. When a bucket is
complete, its all-reduce starts asynchronously, while backward carries on with earlier layers; buckets are
launched strictly in index order so every rank issues the same collectives in the same order. A callback
queued on the autograd engine (by a hook on the forward's outputs, so on the outermost backward even under
reentrant checkpointing) runs when backward ends: it launches what is left, waits for every bucket, and writes
the averaged gradients back, so the optimizer only ever sees synchronised gradients.

What sums a bucket, and where the sums go, is the reducer's collective (:mod:`paratrain.ddp.bucket_collective`):
an all-reduce in place (ddp, zero1), or a reduce-scatter into this rank's part (zero2,
:mod:`paratrain.sharded.reducer`); this module decides when.

States of one iteration: ``idle`` (nothing expected) -> ``sync`` (a forward that will synchronise) or
``local`` (inside ``no_sync``: gradients stay local) -> back to ``idle`` when backward ends.

Parameters without a gradient in a synchronised backward (``find_unused_parameters``, ``static_graph``) are
marked ready at the first gradient of that backward, as torch's reducer does, so every rank launches its buckets
during backward and never between forward and backward, where other collectives of the user may run. Their
bucket slots hold what earlier local backwards (``no_sync``) accumulated, or zeros: torch's rule, under which a
parameter used in any forward since the last synchronisation counts as used.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.process_groups import no_python_in_work
from paratrain.ddp.bucket_collective import AllReduce, CollectiveFactory
from paratrain.ddp.buckets import Bucket, assign_buckets
from paratrain.diagnostics.profiling import phase
from paratrain.errors import DistributedError
from paratrain.tree import flatten

__all__ = ["Reducer"]

_IDLE, _SYNC, _LOCAL = "idle", "sync", "local"


def _queue_end_of_backward(callback: Any) -> None:
    # the autograd engine's own hook for "backward is finished"; torch's reducer and FSDP use it too
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class Reducer:
    """Bucketed, overlapped gradient averaging for one set of parameters.

    ``collective`` builds what sums each bucket over the parameters and the buckets (default: an all-reduce in
    place, the averages copied into ``.grad``); the reducer keeps it as :attr:`collective`.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        names: Sequence[str],
        *,
        group: Any,
        monitor: CollectiveMonitor,
        bucket_cap_bytes: int,
        find_unused: bool,
        collective: CollectiveFactory = AllReduce,
        static_graph: bool = False,
        overlap: bool = True,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.group = group
        self.monitor = monitor
        self.world_size = monitor.world_size
        self.find_unused = find_unused
        self.static_graph = static_graph
        self.overlap = overlap
        # which parameters got a gradient since the last synchronisation, for the used-parameter map
        self.track_used = find_unused or static_graph
        self.buckets: list[Bucket] = assign_buckets(self.params, bucket_cap_bytes)
        self.bucket_of = [0] * len(self.params)
        for b, bucket in enumerate(self.buckets):
            for i in bucket.indices:
                self.bucket_of[i] = b
        self.collective = collective(self.params, self.names, self.buckets, group=group, monitor=monitor)
        # which parameters got a gradient on this rank since the last synchronisation, summed across ranks
        self._used = torch.zeros(len(self.params), dtype=torch.int32, device=self._control_device())
        self._used_since_sync = [False] * len(self.params)
        # static_graph: how many gradient hooks each parameter runs in one backward, and the used map, both learnt
        # in the first synchronised backward and trusted from then on (torch's contract for static_graph=True)
        self._expected: list[int] | None = None
        self._static_used: list[int] | None = None
        self.state = _IDLE
        self.synchronised_steps = 0  # backwards that averaged gradients: static_graph can no longer be turned on
        self.on_synchronised: Callable[[], None] | None = None  # called when a backward's gradients are reduced
        self._retired: list[Any] = []  # the last step's handles (see _retire)
        self._extra: list[Any] = []  # this step's handles outside the buckets (the unused-parameter map)
        self._reset()

    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(b.indices) for b in self.buckets]
        self._next = 0
        self._launched: list[tuple[Any, int]] = []  # (Work or hook future, collective number) per bucket
        self._callback_queued = False
        self._got_gradients = False  # a parameter's hook ran in this backward (not only the outputs')
        self._absent: list[int] = []  # parameters to mark ready without a gradient, at this backward's first hook
        if self.static_graph:
            self._calls = [0] * len(self.params)

    def _control_device(self) -> torch.device:
        return self.buckets[0].device if self.buckets else torch.device("cpu")

    # -- one iteration ----------------------------------------------------------------------------------------

    def prepare(self, sync: bool) -> None:
        """Called by every forward: the next backward synchronises (``sync``) or stays local."""
        self._reset()
        self.state = _SYNC if sync else _LOCAL
        if sync and self._expected is not None:
            self._absent = [i for i, calls in enumerate(self._expected) if calls == 0]
        self.collective.prepare(sync)

    def watch_outputs(self, outputs: Any) -> None:
        """Queue the end-of-backward callback from the outputs' gradients, the first thing backward computes.

        A parameter's hook may run in a nested backward instead (reentrant activation checkpointing of the last
        layers): a callback queued there would run when that nested backward ends, before the outer one has
        produced the other gradients. The outputs' gradients are always computed by the outermost backward.
        """
        ref = weakref.ref(self)
        for t in (outputs,) if isinstance(outputs, torch.Tensor) else flatten(outputs)[0]:
            # not on a leaf (a parameter returned as it is): its hooks would outlive the iteration
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(functools.partial(_output_grad, ref))

    def on_backward(self) -> None:
        """A backward through this iteration's outputs started: finish() runs when it ends."""
        if self.state == _SYNC and not self._callback_queued:
            self.collective.backward_started()
            _queue_end_of_backward(self.finish)
            self._callback_queued = True

    def mark_unreachable(self, outputs: Any) -> None:
        """With find_unused_parameters: parameters the outputs do not depend on get no gradient in this backward."""
        if self.static_graph:
            return  # static_graph learns them in the first iteration, without searching the graph
        reached = _reachable_leaves(outputs)
        self._absent = [i for i, p in enumerate(self.params) if id(p) not in reached]

    def on_grad(self, index: int) -> None:
        """The post-accumulate-grad hook of parameter ``index``."""
        if self.state == _LOCAL:
            if self.track_used:
                self._used_since_sync[index] = True
            return
        if self.state == _IDLE:
            raise DistributedError(
                f"parameter {self.names[index]!r} received a gradient, but no forward through "
                f"DistributedDataParallel prepared this backward: every synchronised backward needs its own "
                f"forward (a second backward over the same graph would leave ranks out of step); use no_sync() "
                f"to accumulate gradients locally"
            )
        if not self._got_gradients:
            self._got_gradients = True
            self.on_backward()
            self._mark_absent_ones()
        if self.track_used:
            self._used_since_sync[index] = True
        if self.static_graph:
            self._calls[index] += 1
            if self._expected is None:
                return  # the first iteration learns the graph: its gradients are copied in when backward ends
            if self._calls[index] != self._expected[index]:
                if self._calls[index] > self._expected[index]:
                    raise DistributedError(self._not_static(f"{self.names[index]!r} received more gradients"))
                return  # more of this parameter's gradient is still to come (reentrant backward, checkpointing)
        elif self._ready[index]:
            raise DistributedError(
                f"parameter {self.names[index]!r} received a gradient after it was marked ready in this backward: "
                f"it is used outside the module's forward (so find_unused_parameters found no path to it from the "
                f"outputs), or it received its gradient twice (reentrant checkpointing). Use it inside forward, or "
                f"pass static_graph=True if the same parameters take part in every iteration"
            )
        grad = self.params[index].grad
        if grad is None:
            self._mark_absent(index)
            return
        self.collective.copy_in(index, grad)
        self._mark_ready(index)

    def _mark_absent_ones(self) -> None:
        absent, self._absent = self._absent, []
        for i in absent:
            self._mark_absent(i)

    def _mark_absent(self, index: int) -> None:
        """Parameter ``index`` gets no gradient in this backward: its slot holds what no_sync accumulated, or 0."""
        if self._ready[index]:
            return
        grad = self.params[index].grad
        if grad is None:
            self.collective.zero_slot(index)
        else:
            self.collective.copy_in(index, grad)
        self._mark_ready(index)

    def _not_static(self, what: str) -> str:
        return (
            f"static_graph=True, but {what} in this backward than in the first one: the set of parameters that "
            f"take part, and how often, must not change between iterations. Pass static_graph=False (with "
            f"find_unused_parameters=True if some parameters sit out some iterations)"
        )

    def _mark_ready(self, index: int) -> None:
        self._ready[index] = True
        self._pending[self.bucket_of[index]] -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        # strictly in index order: every rank then issues the same collectives in the same order
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        seq = self.monitor.launched()
        collective = self.collective
        with phase(f"paratrain::DistributedDataParallel.{collective.label} (bucket {b})"), no_python_in_work():
            handle = collective.start(b, seq)
        self._launched.append((handle, seq))

    def finish(self) -> None:
        """End of backward: launch what is left, wait for every bucket, write the averages into ``.grad``."""
        if self.state != _SYNC:
            return
        if not self._got_gradients:
            # a backward that reached no parameter (torch.autograd.grad for a gradient penalty, say): the
            # synchronised backward is still to come
            self._callback_queued = False
            return
        try:
            self._mark_absent_ones()
            learning = self.static_graph and self._expected is None
            if learning:
                for i, calls in enumerate(self._calls):
                    grad = self.params[i].grad
                    if calls and grad is not None and not self._ready[i]:
                        self.collective.copy_in(i, grad)
                        self._mark_ready(i)
            missing = [self.names[i] for i, ready in enumerate(self._ready) if not ready]
            if missing and not (self.find_unused or learning):
                listed = f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
                if self.static_graph:
                    raise DistributedError(self._not_static(f"{listed} received fewer gradients"))
                raise DistributedError(
                    f"{len(missing)} parameter(s) received no gradient in this backward: {listed}. Every rank "
                    f"would wait for them forever; pass find_unused_parameters=True if some parameters legitimately "
                    f"sit out a step, or make them take part in the loss"
                )
            for i in range(len(self.params)):
                self._mark_absent(i)  # only those not ready yet
            self._launch_ready()
            used_work = self._reduce_used() if self._reduces_used_map() else None
            # which parameters some rank used: known now (all, or static_graph's map), or summed after the buckets
            used: list[int] | None = self._static_used if self.track_used else None
            collective = self.collective
            for b, (handle, seq) in enumerate(self._launched):
                with phase(f"paratrain::DistributedDataParallel.wait (bucket {b})"):
                    result = self.monitor.wait(handle, seq, f"gradient {collective.name} of bucket {b}")
                collective.done(b, result)
                if used_work is None:  # its results written while the next buckets are still in flight
                    with torch.no_grad():  # backward(create_graph=True) leaves gradients that belong to a graph
                        collective.write_bucket(b, used)
            if used_work is not None:
                self.monitor.wait(used_work[0], used_work[1], "unused-parameter map")
                used = self._used.tolist()
            with torch.no_grad():
                if used_work is not None:
                    for b in range(len(self._launched)):
                        collective.write_bucket(b, used)
                collective.write_back(used)
            if learning:
                self._expected, self._static_used = self._calls, used
            if self.track_used:
                self._used_since_sync = [False] * len(self.params)
            self.synchronised_steps += 1
            if self.on_synchronised is not None:
                self.on_synchronised()
        finally:
            self.state = _IDLE
            self._callback_queued = False
            self._retire()

    def _reduces_used_map(self) -> bool:
        """Whether this backward sums the used-parameter map across ranks (static_graph learns it once)."""
        return self.track_used and self._static_used is None

    def _reduce_used(self) -> tuple[Any, int]:
        self._used.copy_(torch.tensor(self._used_since_sync, dtype=torch.int32))
        seq = self.monitor.launched()
        with no_python_in_work():
            handle = dist.all_reduce(self._used, group=self.group, async_op=True)
        self._extra.append(handle)
        return handle, seq

    def _retire(self) -> None:
        """Keep this step's handles until the next step ends, and let go of the previous step's.

        As torch's reducer keeps its bucket works: the backend's thread that ran a collective then never holds
        the last reference to it, so it never frees it (nor what it holds) while the interpreter shuts down.
        """
        self._retired = [handle for handle, _ in self._launched] + self._extra
        self._launched, self._extra = [], []

    def shadow(self) -> None:
        """Join the other ranks' gradient collectives with zeros (this rank has run out of data)."""
        self.collective.reducible_outside_backward()
        for buffer in self.collective.buffers:
            buffer.zero_()
        self._used_since_sync = [False] * len(self.params)
        self.reduce_buffers("joined rank")

    def reduce_buffers(self, why: str = "") -> None:
        """All-reduce every bucket's buffer as it is now, outside backward (joined ranks; benchmarks)."""
        self.collective.reducible_outside_backward()
        self._reset()
        for b in range(len(self.buckets)):
            self._launch(b)
        used = self._reduce_used() if self._reduces_used_map() else None
        suffix = f" ({why})" if why else ""
        for b, (handle, seq) in enumerate(self._launched):
            self.monitor.wait(handle, seq, f"gradient {self.collective.name} of bucket {b}{suffix}")
        if used is not None:
            self.monitor.wait(used[0], used[1], f"unused-parameter map{suffix}")
        self._retire()
        self._reset()


def _output_grad(reducer_ref: weakref.ref[Reducer], grad: torch.Tensor) -> None:
    reducer = reducer_ref()
    if reducer is not None:
        reducer.on_backward()


def _reachable_leaves(outputs: Any) -> set[int]:
    """ids of the leaf tensors the outputs' autograd graph reaches (their AccumulateGrad nodes)."""
    leaves, _ = flatten(outputs)
    reached: set[int] = set()
    stack = []
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            if t.grad_fn is None:
                reached.add(id(t))
            else:
                stack.append(t.grad_fn)
    seen: set[Any] = set()
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
    return reached
