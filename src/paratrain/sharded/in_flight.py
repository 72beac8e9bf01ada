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

from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from paratrain.comm.collectives import CollectiveMonitor
from paratrain.comm.process_groups import keep_forever

__all__ = ["WeightsInFlight"]


class WeightsInFlight:
    """The all-gathers of updated weights not waited for yet, and the mode that makes reads of them wait."""

    def __init__(self, buffers: Sequence[torch.Tensor], monitor: CollectiveMonitor) -> None:
        self._monitor = monitor
        self._bucket_of = {_storage(t): b for b, t in enumerate(buffers) if t.numel()}
        self._pending: dict[int, tuple[Any, int]] = {}  # bucket -> (Work, collective number), in launch order
        self._mode: _ReadsWait | None = None  # entered while anything is in flight (or until it can leave)
        self._hook: Any = None  # a forward pre-hook on every module, while the mode is entered: poll()
        self.deferred = 0  # all-gathers that a step left in flight (tests count them)
        self.read_waits = 0  # buckets an operation waited for before it ran

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def hold(self, gathers: Sequence[tuple[int, Any, int]]) -> None:
        """``gathers`` were launched: leave them in flight, every read of their buckets waiting for them first.

        Waits for them at once instead when another dispatch mode is active (see the module docstring)."""
        for b, work, seq in gathers:
            self._pending[b] = (work, seq)
        if not self._pending:
            return
        if self._mode is None and torch._C._len_torch_dispatch_stack() > 0:
            self.settle()
            return
        self.deferred += len(gathers)
        if self._mode is None:
            self._mode = _ReadsWait(self)
            self._mode.__enter__()
            self._hook = register_module_forward_pre_hook(lambda module, args: self.poll())

    def wait_for(self, tensors: Sequence[Any]) -> None:
        """Wait for the all-gather of every bucket in flight that one of ``tensors`` (or a list of them) touches."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                b = self._bucket_of.get(_storage(t))
                if b is not None and b in self._pending:
                    self.read_waits += 1
                    self._wait(b)
            elif isinstance(t, (list, tuple)):
                self.wait_for(t)
            if not self._pending:
                return

    def poll(self) -> None:
        """Finish the all-gathers already done; leave the mode when none is in flight."""
        for b, (work, _) in list(self._pending.items()):
            if not work.is_completed():
                break  # gloo completes a group's collectives in launch order
            self._wait(b)
        if not self._pending:
            self._leave()

    def settle(self) -> None:
        """Wait for every all-gather in flight, and leave the mode: from here on the weights are whole."""
        for b in list(self._pending):
            self._wait(b)
        self._leave()

    def drop(self) -> None:
        """Stop tracking what is in flight, without waiting (the job is ending on an error): gloo may still write
        into the buffers, so each Work is kept to the end of the process."""
        for work, _ in self._pending.values():
            keep_forever(work)
        self._pending.clear()
        self._leave()

    def _wait(self, b: int) -> None:
        work, seq = self._pending.pop(b)
        self._monitor.wait(work, seq, f"all-gather of updated parameters, bucket {b}")

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


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s memory (views of one buffer share it); 0 for a tensor without storage."""
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a wrapper subclass (the sharded gradients' placeholders)
        return 0
