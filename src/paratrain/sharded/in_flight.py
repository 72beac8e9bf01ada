"""zero1's and zero2's updated weights, all-gathered while the script goes on: every read of them waits first.

    in_flight = WeightsInFlight(buffers, monitor)   # the flat buffers the model's parameters are views of
    in_flight.hold([(bucket, work, seq), ...])      # the step launched these all-gathers; it returns at once
    ema.update(model.parameters())                  # an op on a weight in flight waits for its bucket, then runs
    model(x)                                        # the forward's first layer waits for its bucket only
    in_flight.settle()                              # wait for every one (the forward's end, the next step, save)

After the update every rank all-gathers each bucket's new weights from their owners. Waiting for those inside
``step()`` leaves them exposed; FSDP hides them behind the next forward, whose weights at rest are shards that
no other code can read. Ours rest as whole tensors that a script may read between the step and the forward (an
EMA, a checkpoint, a histogram), which would see weights half written. So while a bucket's all-gather is in
flight, a dispatch mode (:class:`_ReadsWait`) looks at every torch operation this thread runs: one that touches
a bucket in flight (its storage) waits for that bucket's all-gather first, and then runs. The forward's own
operations wait as they reach each bucket (the step gathers the first layers' buckets first), so the first layer
computes while the last layers' weights arrive. The mode leaves as soon as nothing is in flight: when a module
starts its forward and finds every all-gather done (:meth:`poll`, a global forward pre-hook registered only
while the mode is entered), and at the latest when the wrapper's forward returns, so backward never runs under
it. Code compiled with ``torch.compile`` runs eagerly while the mode is entered (dynamo steps aside for dispatch
modes), which is correct, and only until the all-gathers are done.

What the mode cannot see, and waits explicitly instead: what reads a tensor's memory without a torch operation
(``torch.save`` of the raw tensors, ``.numpy()`` of ``p.data``), which paratrain's save, state dicts and
pickling settle before; and another thread's reads (the mode is this thread's).

Deferring is skipped (the step waits, as before) when another dispatch mode is active at the end of the step:
a mode entered around the step and left before the next forward would otherwise pop ours off the stack.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.process_groups import keep_forever

__all__ = ["CHUNK_ELEMENTS", "Gather", "WeightsInFlight", "chunks"]

CHUNK_ELEMENTS = 1 << 20  # the most elements of each rank's part that one all-gather carries (4 MiB of fp32)


def chunks(part: int, most: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """``[0, part)`` cut into near-equal ranges of at most ``most`` elements, the highest first.

    Every rank's part of a bucket is gathered range by range, the same range of each part at once. A bucket holds
    its parameters in reverse order, so the highest range of the last part holds the first layers: gathered first,
    the forward's first layer waits for it alone."""
    if part <= 0:
        return []
    count = -(-part // most)
    bounds = [part * i // count for i in range(count + 1)]
    return [(bounds[i], bounds[i + 1]) for i in reversed(range(count))]


@dataclass
class Gather:
    """One all-gather in flight: range ``[lo, hi)`` of every rank's part of bucket ``bucket``; ``work`` is its
    ``Work``, or at two ranks on gloo the future of its send and receive."""

    bucket: int
    lo: int
    hi: int
    work: Any
    seq: int


class WeightsInFlight:
    """The all-gathers of updated weights not waited for yet, and the mode that makes reads of them wait."""

    def __init__(self, buffers: Sequence[torch.Tensor], parts: Sequence[int], monitor: CollectiveMonitor) -> None:
        self._monitor = monitor
        self._buffers = list(buffers)
        self._parts = list(parts)
        self._bucket_of = {_storage(t): b for b, t in enumerate(buffers) if t.numel()}
        self._pending: list[Gather] = []  # in launch order
        self._mode: _ReadsWait | None = None  # entered while anything is in flight (or until it can leave)
        self._hook: Any = None  # a forward pre-hook on every module, while the mode is entered: poll()
        self._thread = threading.get_ident()  # the thread whose operations the mode sees (the step's)
        self.deferred = 0  # all-gathers that a step left in flight (tests count them)
        self.read_waits = 0  # all-gathers an operation waited for before it ran

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def hold(self, gathers: Sequence[Gather]) -> None:
        """``gathers`` were launched: leave them in flight, every read of what they write waiting for them first.

        Waits for them at once instead when another dispatch mode is active (see the module docstring)."""
        self._pending.extend(gathers)
        if not self._pending:
            return
        if self._mode is None and torch._C._len_torch_dispatch_stack() > 0:
            self.settle()
            return
        self.deferred += len(gathers)
        if self._mode is None:
            self._thread = threading.get_ident()
            self._mode = _ReadsWait(self)
            self._mode.__enter__()
            self._hook = register_module_forward_pre_hook(lambda module, args: self.poll())

    def wait_for(self, tensors: Sequence[Any]) -> None:
        """Wait for every all-gather in flight that writes what one of ``tensors`` (or a list of them) covers."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                b = self._bucket_of.get(_storage(t))
                if b is not None:
                    self._wait_covering(b, t)
            elif isinstance(t, (list, tuple)):
                self.wait_for(t)
            if not self._pending:
                return

    def _wait_covering(self, b: int, t: torch.Tensor) -> None:
        part, buffer = self._parts[b], self._buffers[b]
        whole = not t.is_contiguous() or t.dtype != buffer.dtype  # its extent is not one range: all of the bucket
        start = t.storage_offset()
        end = start + t.numel()
        ranks = range(-(-end // part))  # the parts [start, end) may reach
        for gather in [g for g in self._pending if g.bucket == b]:
            if whole or any(start < r * part + gather.hi and r * part + gather.lo < end for r in ranks):
                self.read_waits += 1
                self._wait(gather)

    def poll(self) -> None:
        """Finish the all-gathers already done; leave the mode when none is in flight. Only in the thread that
        stepped (a module run by another thread is not this one's forward)."""
        if threading.get_ident() != self._thread:
            return
        while self._pending and _finished(self._pending[0].work):  # gloo completes them in launch order
            self._wait(self._pending[0])
        if not self._pending:
            self._leave()

    def settle(self) -> None:
        """Wait for every all-gather in flight, and leave the mode: from here on the weights are whole."""
        while self._pending:
            self._wait(self._pending[0])
        self._leave()

    def drop(self) -> None:
        """Stop tracking what is in flight, without waiting (the job is ending on an error): gloo may still write
        into the buffers, so each Work is kept to the end of the process."""
        for gather in self._pending:
            keep_forever(gather.work)
        self._pending.clear()
        self._leave()

    def _wait(self, gather: Gather) -> None:
        self._pending.remove(gather)
        what = f"all-gather of updated parameters, bucket {gather.bucket}"
        try:
            self._monitor.wait(gather.work, gather.seq, what)
        except BaseException:
            self.drop()  # the job is failing: later reads must not wait for the rest, each to its timeout
            raise

    def _leave(self) -> None:
        mode = self._mode
        if mode is not None and _get_current_dispatch_mode() is mode:  # never pop a mode of someone else's
            self._mode = None
            mode.__exit__(None, None, None)
            self._hook.remove()
            self._hook = None
        # otherwise a mode entered after ours is above it: ours stays, passing every operation through, and
        # leaves at the next poll or settle that finds it on top


class _ReadsWait(TorchDispatchMode):
    """Every operation on a bucket whose all-gather is in flight waits for it first (module docstring)."""

    def __init__(self, weights: WeightsInFlight) -> None:
        super().__init__()
        self.weights = weights

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.weights.pending:
            self.weights.wait_for(args)
            if kwargs:
                self.weights.wait_for(list(kwargs.values()))
        return func(*args, **kwargs)


def _finished(work: Any) -> bool:
    """Whether an all-gather's ``Work``, or the future of a send and receive (:mod:`paratrain.comm.work_waiter`), is
    done."""
    return bool(work.done() if isinstance(work, torch.futures.Future) else work.is_completed())


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s memory (views of one buffer share it); 0 for a tensor without storage."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (the sharded gradients' placeholders)
        return 0
