"""zero1's and zero2's updated weights, all-gathered while the script goes on, and the points that wait for them.

    in_flight = WeightsInFlight(model, bucket_of, monitor)   # bucket_of: each bucketed parameter's bucket, by id
    in_flight.hold([Gather(bucket, work, seq), ...])         # the step launched these all-gathers; it returns at once
    model(x)                                                 # each module's forward waits for its own buckets first
    in_flight.settle()                                       # every one (the forward's end, state_dict, save, close)

After the update every rank all-gathers each bucket's new weights from their owners. Waiting for those inside
``step()`` leaves them exposed; as FSDP2 and Megatron's ``overlap_param_gather`` do, they are waited for where they
are needed instead: a forward pre-hook on every module that holds bucketed parameters waits for those parameters'
buckets, so the first layer computes while the last layers' weights arrive (the step gathers the first layers'
buckets first). The wrapper's forward settles whatever its modules did not reach before it returns, so backward
never runs with an all-gather in flight; ``state_dict``, ``Parallel.save``, ``close`` and the next ``step`` settle
too, and ``Parallel.wait_weights()`` is the public wait for code that reads the weights between the step and the
next forward (an EMA, a histogram): the table in docs/sharding.md.

Where the backend waits on the device (NCCL: the current stream waits for the collective, the host goes on) the
step's end waits at once: nothing is left to the hooks, and later kernels see the gathered weights in order.

Under ``torch.compile`` the wrapper settles before the compiled module runs (one graph break at the top of the
wrapper's forward when the wrapper itself is compiled), so the hooks inside the compiled graph find nothing in
flight and the module's forward stays one graph.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.process_groups import keep_forever

__all__ = ["Gather", "WeightsInFlight", "settle_outside_graph"]


@dataclass
class Gather:
    """One bucket's all-gather of updated weights in flight: its ``Work`` and collective number."""

    bucket: int
    work: Any
    seq: int


class WeightsInFlight:
    """The all-gathers of updated weights not waited for yet, and the hooks that wait for them where they are read."""

    def __init__(self, module: nn.Module, bucket_of: dict[int, int], monitor: CollectiveMonitor) -> None:
        self._monitor = monitor
        self._pending: dict[int, Gather] = {}  # by bucket, in launch order
        self._defer = monitor.host_waits  # NCCL waits on the stream: the step's end waits at once
        self.deferred = 0  # all-gathers that a step left in flight (tests count them)
        self.hook_waits = 0  # all-gathers a module's forward waited for before it ran
        self._handles: list[RemovableHandle] = []
        ref = weakref.ref(self)
        # where the step's end waits (NCCL) nothing is ever in flight at a forward: no hooks on the forward's path
        for sub in module.modules() if self._defer else ():
            buckets = sorted({bucket_of[id(p)] for p in sub.parameters(recurse=False) if id(p) in bucket_of})
            if buckets:
                hook = functools.partial(_before_forward, ref, tuple(buckets))
                self._handles.append(sub.register_forward_pre_hook(hook))
        # a state dict of the model (or of any module in it, through the wrapper or not) copies whole weights
        self._handles.append(module.register_state_dict_pre_hook(functools.partial(_before_state_dict, ref)))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def hold(self, gathers: Sequence[Gather]) -> None:
        """``gathers`` were launched: leave them in flight for the forward's hooks (or, NCCL, wait on the stream)."""
        for gather in gathers:
            self._pending[gather.bucket] = gather
        if not self._defer:
            self.settle()
            return
        self.deferred += len(gathers)

    def wait_buckets(self, buckets: Iterable[int]) -> None:
        """Wait for the all-gathers in flight of ``buckets``."""
        for b in buckets:
            gather = self._pending.get(b)
            if gather is not None:
                self.hook_waits += 1
                self._wait(gather)

    def settle(self) -> None:
        """Wait for every all-gather in flight: from here on the weights are whole."""
        while self._pending:
            self._wait(next(iter(self._pending.values())))

    def drop(self) -> None:
        """Stop tracking what is in flight, without waiting (the job is ending on an error): gloo may still write
        into the buffers, so each Work is kept to the end of the process."""
        for gather in self._pending.values():
            keep_forever(gather.work)
        self._pending.clear()

    def close(self) -> None:
        """Remove the hooks from the user's modules."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _wait(self, gather: Gather) -> None:
        del self._pending[gather.bucket]
        what = f"all-gather of updated parameters, bucket {gather.bucket}"
        try:
            self._monitor.wait(gather.work, gather.seq, what)
        except BaseException:
            self.drop()  # the job is failing: later reads must not wait for the rest, each to its timeout
            raise


def _before_forward(ref: weakref.ref[WeightsInFlight], buckets: tuple[int, ...], module: nn.Module, args: Any) -> None:
    weights = ref()
    if weights is not None and weights._pending:
        _wait_outside_graph(weights, buckets)


def _before_state_dict(ref: weakref.ref[WeightsInFlight], module: nn.Module, prefix: str, keep_vars: bool) -> None:
    weights = ref()
    if weights is not None:
        weights.settle()


@torch._dynamo.disable  # type: ignore[untyped-decorator]  # a collective's wait: eager, a graph break where it is reached
def _wait_outside_graph(weights: WeightsInFlight, buckets: tuple[int, ...]) -> None:
    weights.wait_buckets(buckets)


@torch._dynamo.disable  # type: ignore[untyped-decorator]
def settle_outside_graph(weights: WeightsInFlight) -> None:
    """:meth:`WeightsInFlight.settle`, run eagerly when reached inside code that ``torch.compile`` traces."""
    weights.settle()
